"""HTTPS for the tracker and the API: a configured certificate, or one made here and pinned.

Server side: ``--tls-cert FILE --tls-key FILE`` serves a certificate the
operator has (one a CA signed, so browsers and the official ``openai`` client
trust it as they are); ``--tls`` makes a self-signed one on first use, keeps it
(key 0600) and prints its SHA-256 fingerprint. Clients of a self-signed
tracker pin that fingerprint in the URL: ``https://HOST:PORT#sha256=HEX``.
Plain HTTP stays the default on loopback only; off loopback it takes
``--insecure`` (a closed lab network).

Client side (``pinned_context``): one TLS handshake reads the certificate the
server presents; its SHA-256 must be the pinned one, and the request then
trusts that certificate alone. No certificate authority, no trust on first
use. Without a pin, an https:// URL is checked against the system's CAs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import trio

from meshnode import atomicfile, errors


@dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert.read_bytes())


def fingerprint(cert_pem_or_der: bytes) -> str:
    """SHA-256 of the certificate's DER, lower-case hex (what ``#sha256=`` pins)."""
    der = (ssl.PEM_cert_to_DER_cert(cert_pem_or_der.decode())
           if cert_pem_or_der.lstrip().startswith(b"-----BEGIN") else cert_pem_or_der)
    return hashlib.sha256(der).hexdigest()


def make_self_signed(names: list[str]) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM): ECDSA P-256, valid for ``names`` (host names or IP addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "meshnode")])
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1))
               .not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True))
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


def self_signed(directory: Path, stem: str, names: list[str]) -> TLSFiles:
    """``directory/stem.crt`` and ``stem.key`` (0600), made on first use and kept (the pin stays valid)."""
    files = TLSFiles(directory / f"{stem}.crt", directory / f"{stem}.key")
    if files.cert.exists() and files.key.exists():
        mode = files.key.stat().st_mode & 0o777
        if mode & 0o077:
            raise errors.InputError(f"{files.key} is readable by others (mode {mode:o}); it must be 0600")
        return files
    key, cert = make_self_signed(names)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomicfile.write(files.key, key, 0o600)
    atomicfile.write(files.cert, cert, 0o644)
    return files


def configured(cert: str | None, key: str | None) -> TLSFiles | None:
    """``--tls-cert`` / ``--tls-key``: both or neither; InputError for a missing or unreadable pair."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise errors.InputError("give --tls-cert and --tls-key together")
    files = TLSFiles(Path(cert), Path(key))
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as e:
        raise errors.InputError(f"cannot use --tls-cert {cert} with --tls-key {key}: {e}") from e
    return files


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plain(listen_host: str, what: str, *, insecure: bool,
                flags: str = "--tls (a self-signed certificate, pinned by its printed fingerprint), "
                             "--tls-cert FILE --tls-key FILE") -> None:
    """Plain HTTP off loopback needs ``--insecure``; InputError otherwise, saying what to give (``flags``)."""
    if not insecure and not is_loopback(listen_host):
        raise errors.InputError(
            f"{what} on {listen_host} (not loopback) would be plain HTTP: give {flags}, or --insecure on a closed "
            "network")


# -- the flags, shared by the tracker and the API --------------------------------------------------------


def add_tls_flags(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--tls", action="store_true",
                    help=f"serve {what} over HTTPS with a self-signed certificate made once and kept; its "
                         "sha256 fingerprint is printed for clients to pin (https://HOST:PORT#sha256=HEX)")
    ap.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    ap.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    ap.add_argument("--insecure", action="store_true",
                    help="allow plain HTTP off loopback (a closed lab network only)")


def tls_of(ns: argparse.Namespace, host: str, what: str, keep: Path, stem: str) -> TLSFiles | None:
    """The HTTPS files the flags ask for (a self-signed pair kept under ``keep``), or None for plain HTTP."""
    files = configured(ns.tls_cert, ns.tls_key)
    if files is not None and ns.tls:
        raise errors.InputError("give --tls or --tls-cert/--tls-key, not both")
    if files is None and ns.tls:
        files = self_signed(keep, stem, [host] if host not in ("0.0.0.0", "::", "") else [])
    if files is None:
        check_plain(host, what, insecure=ns.insecure)
    return files


def base_url(host: str, port: int, tls: TLSFiles | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def pin_note(tls: TLSFiles | None, who: str, host: str, port: int) -> str:
    """What to tell clients of a self-signed certificate: the pinned URL."""
    if tls is None:
        return ""
    return f"; certificate sha256={tls.fingerprint} ({who} {base_url(host, port, tls)}#sha256={tls.fingerprint})"


# -- the client side -------------------------------------------------------------------------------------


def pin_of(url: str) -> str | None:
    """The ``sha256=HEX`` pin in a URL's fragment, if any; InputError for a malformed one."""
    frag = urllib.parse.urlsplit(url).fragment
    if not frag:
        return None
    name, _, value = frag.partition("=")
    value = value.lower().replace(":", "")
    if name != "sha256" or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise errors.InputError(f"{url!r}: a pin is #sha256= and 64 hex digits (the tracker prints it)")
    if urllib.parse.urlsplit(url).scheme != "https":
        raise errors.InputError(f"{url!r}: a #sha256= pin goes with https://")
    return value


async def pinned_context(host: str, port: int, pin: str, timeout: float = 10.0) -> ssl.SSLContext:
    """A TLS context trusting exactly the certificate ``host:port`` presents, if its SHA-256 is ``pin``."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE  # the fingerprint is the check
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=probe, https_compatible=True)
            try:
                await stream.do_handshake()
                der = stream.getpeercert(binary_form=True)
            finally:
                await trio.aclose_forcefully(stream)
    except trio.TooSlowError:
        raise errors.PeerError(f"no TLS handshake within {timeout:g}s", hop=f"{host}:{port}") from None
    except (OSError, ssl.SSLError, trio.BrokenResourceError) as e:
        raise errors.TransportSecurityError(f"no TLS handshake ({e!r}): is it https://?", hop=f"{host}:{port}") from e
    if not der:
        raise errors.TransportSecurityError("presented no certificate", hop=f"{host}:{port}")
    found = hashlib.sha256(der).hexdigest()
    if found != pin:
        raise errors.ImpostorError(f"presents the certificate sha256={found}, not the pinned sha256={pin}",
                                   hop=f"{host}:{port}")
    ctx = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    ctx.check_hostname = False  # the pinned certificate itself is the trust: whatever name it carries
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-issued certificate pinned as itself
    return ctx
