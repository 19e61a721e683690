"""A TLS server context that follows its certificate files: rewrite tls.crt / tls.key (cert-manager renewing a
Secret, `kube-vgpu certs`) and new connections get the new certificate, with no restart and no dropped connection.

How: the server's SSLContext has an SNI callback, which OpenSSL calls on every handshake (with or without SNI);
it switches the connection to the context built from the newest valid pair. A pair that does not load (half
written, key and cert mismatched) is refused and the previous one kept, so a bad rotation never takes us down.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

log = logging.getLogger("kube_vgpu.webhook.tls")

DEFAULT_RELOAD_INTERVAL_S = 10.0


class ReloadingCertificate:
    def __init__(
        self,
        cert_file: str | Path,
        key_file: str | Path,
        *,
        on_reload: Callable[[bool, float | None], None] | None = None,
    ) -> None:
        """Loads the pair now (raises ssl.SSLError / OSError when it cannot); `on_reload(ok, not_after_s)` is
        called after every attempt to load a changed pair, and once for the initial one."""
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        digest, context, not_after_s = self._load()
        self._digest = digest
        self._failed_digest: bytes | None = None
        self._current = context
        # The context handed to the server: it holds the first pair (OpenSSL needs one to start the handshake) and
        # redirects each handshake to the current context.
        self.server_context = self._load_context()
        self.server_context.sni_callback = self._select
        if on_reload:
            on_reload(True, not_after_s)

    @property
    def current_context(self) -> ssl.SSLContext:
        return self._current

    def _select(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self._current  # one atomic read; a reload may swap it at any moment
        if current is not context:
            connection.context = current

    def _load_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        context.load_cert_chain(self.cert_file, self.key_file)  # also checks that the key matches the cert
        return context

    def _load(self) -> tuple[bytes, ssl.SSLContext, float | None]:
        digest = self._digest_files()
        context = self._load_context()
        return digest, context, _not_after_s(self.cert_file)

    def _digest_files(self) -> bytes:
        hasher = hashlib.sha256(self.cert_file.read_bytes())
        hasher.update(b"\0")
        hasher.update(self.key_file.read_bytes())
        return hasher.digest()

    def check(self) -> bool:
        """Reload when the files changed; True when a new pair is now served."""
        with self._lock:
            try:
                digest = self._digest_files()
            except OSError as exc:  # mid-rotation (a Secret's symlink swap) or gone: keep serving the old pair
                log.warning("cannot read certificate files: %s", exc)
                return False
            if digest in (self._digest, self._failed_digest):
                return False
            try:
                loaded_digest, context, not_after_s = self._load()
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._failed_digest = digest  # count and log a bad pair once, not at every check
                log.warning("new certificate files do not load, still serving the previous ones: %s", exc)
                if self._on_reload:
                    self._on_reload(False, None)
                return False
            # The files may have changed again between the digest and the load; the next check catches that.
            self._digest, self._current = loaded_digest, context
            log.info("serving certificate reloaded from %s", self.cert_file)
            if self._on_reload:
                self._on_reload(True, not_after_s)
            return True

    def start(self, interval_s: float = DEFAULT_RELOAD_INTERVAL_S) -> None:
        """Check the files every `interval_s` seconds in a daemon thread until stop()."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.check()

        self._thread = threading.Thread(target=loop, name="cert-reloader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _not_after_s(cert_file: Path) -> float | None:
    try:
        return x509.load_pem_x509_certificate(cert_file.read_bytes()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return None
