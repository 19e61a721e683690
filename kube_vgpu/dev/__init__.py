"""Developer tools on top of the components: synthetic clusters, the local control plane, the demo, the
trace-driven simulator and the fixtures shared by tests, benchmarks and the demo. Nothing below imports this."""
