"""A lower tier's secret: the secret file, the keys derived from it, keyed blocks and names.

A tier section may name ``secret_file:`` (a file of at least 32 random bytes, mode 0600 or
0400, owned by the user running kvtier) and ``encrypt: aes-gcm``. With a secret:

* every block written carries a 16-byte tag over its header and payload, under a key derived
  from the secret and the block's own random 16-byte salt (format version 2,
  :mod:`kvtier.tiers.disk.format`); a block whose tag does not hold — written without the
  secret, under another one, or planted — is a counted miss, never served;
* on the shared tier, value names and the key inside each header are keyed digests of the
  offload key, and the default namespace derives from the secret, so nobody without it can
  tell whether a given prefix is cached;
* with ``encrypt: aes-gcm`` the payload is stored as AES-256-GCM ciphertext (the GCM tag is
  the block's tag).

The MAC is GMAC: AES-256-GCM over no plaintext with the payload as associated data, under a
key of the block's own, a keyed BLAKE2b of its header (salt included), so the tag vouches for
the header too; encryption is AES-256-GCM under such a key. The salt makes each key serve one
message, so GCM's nonce (fixed at zero) never repeats under a key. Why GMAC, and the MACs
rejected: docs/design/secrets.md.

AES-GCM and GMAC come from the ``cryptography`` package (kvtier's ``secure`` extra);
a section with a secret refuses to load without it, with that fix.

Who calls what: the configuration parser (:func:`parse_secret_options`), a tier's opener
(:func:`tier_keys`, once, on its own thread; it reads the file), and the tiers' I/O threads
(:meth:`TierKeys.seal`, :meth:`TierKeys.open`; thread-safe, no shared mutable state).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from typing import Any

import xxhash

from kvtier.errors import ConfigError
from kvtier.extras import install_hint
from kvtier.tiers.disk.format import (
    FLAG_ENCRYPTED,
    FLAG_KEYED,
    NO_CODEC,
    SALT_BYTES,
    BlockHeader,
    encode_header_into,
    header_flags,
    mac_parts,
    set_tag,
)

__all__ = [
    "ENCRYPT_CHOICES",
    "SECRET_MIN_BYTES",
    "TierKeys",
    "encode_block_header",
    "parse_secret_options",
    "read_private_file",
    "read_secret_file",
    "tier_keys",
]

#: ``encrypt`` values: none (the default), aes-gcm (needs secret_file)
ENCRYPT_CHOICES = ("none", "aes-gcm")
#: the fewest bytes a secret file holds (256 bits)
SECRET_MIN_BYTES = 32
#: a longer file is not a secret file (a path typed wrong): refused rather than read whole
SECRET_MAX_BYTES = 1 << 16
_GCM_NONCE = bytes(12)  # each per-block key seals one message, so a fixed nonce never repeats
_FIX_CREATE = "create one: head -c 32 /dev/urandom > FILE && chmod 600 FILE"


def parse_secret_options(section: Mapping[str, object], field: str) -> dict[str, object]:
    """``secret_file`` and ``encrypt`` from a tier ``section`` (keyword arguments for its
    config class). Only the values are checked here; the file is read when the tier opens."""
    options: dict[str, object] = {}
    secret_file = section.get("secret_file")
    if secret_file is not None:
        if not isinstance(secret_file, str) or not secret_file.strip():
            raise ConfigError(
                f"{field}.secret_file",
                secret_file,
                "the path of a file of >= 32 random bytes",
                _FIX_CREATE + ", and write its path",
            )
        options["secret_file"] = secret_file
    encrypt = section.get("encrypt", "none")
    if encrypt is False or encrypt is None:
        encrypt = "none"
    if encrypt not in ENCRYPT_CHOICES:
        raise ConfigError(
            f"{field}.encrypt",
            encrypt,
            "one of " + ", ".join(ENCRYPT_CHOICES),
            "write encrypt: aes-gcm, or leave it out",
        )
    if encrypt != "none" and secret_file is None:
        raise ConfigError(
            f"{field}.encrypt",
            encrypt,
            "encryption under a secret: secret_file set too",
            "add secret_file: /path/to/secret (" + _FIX_CREATE + ")",
        )
    if "encrypt" in section:
        options["encrypt"] = encrypt
    return options


def read_private_file(path: str, field: str, *, max_bytes: int, fix: str) -> bytes:
    """The bytes of the secret file ``path`` (a tier's secret, a server's password), refused
    with a :class:`ConfigError` naming ``field`` (never showing the bytes) unless it is a
    regular file, opened without following a symlink nor waiting on a FIFO, owned by this
    user, readable by no one else, of at most ``max_bytes``. ``fix`` says how to make one."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(
            field, path, "a readable regular file, not a symlink", f"{exc.strerror}; {fix}"
        ) from None
    try:
        info = os.fstat(fd)  # the file opened, not whatever the path names a moment later
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(field, path, "a regular file (not a FIFO, device or folder)", fix)
        if info.st_uid != os.geteuid():
            raise ConfigError(
                field,
                path,
                f"a file owned by this user (uid {os.geteuid()}), not uid {info.st_uid}",
                f"chown it to the user running kvtier, or copy it to a file of your own; {fix}",
            )
        if info.st_mode & 0o077:
            raise ConfigError(
                field,
                path,
                f"mode 0600 or 0400, not {stat.S_IMODE(info.st_mode):04o}: readable by others is not secret",
                f"chmod 600 {path} (and make a new secret: others may have read this one)",
            )
        data = b""
        while len(data) <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(field, path, f"at most {max_bytes} bytes", fix)
    return data


def read_secret_file(path: str, field: str) -> bytes:
    """The secret in ``path`` (see :func:`read_private_file`), of :data:`SECRET_MIN_BYTES` to
    :data:`SECRET_MAX_BYTES` bytes; a :class:`ConfigError` naming ``field`` otherwise."""
    secret = read_private_file(path, field, max_bytes=SECRET_MAX_BYTES, fix=_FIX_CREATE)
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(
            field, path, f"{SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes, not {len(secret)}", _FIX_CREATE
        )
    return secret


def _crypto() -> Any:
    """The ``cryptography`` pieces used here (Cipher, AES, GCM, AESGCM, InvalidTag), or None."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None
    return Cipher, algorithms.AES, modes.GCM, AESGCM, InvalidTag


def tier_keys(config: Any, field: str) -> TierKeys | None:
    """The keys of a tier section with ``secret_file`` (and ``encrypt``), or None without one.

    Reads the file (once, at open). Raises :class:`ConfigError` for a file that fails
    :func:`read_secret_file`'s checks, or when ``cryptography`` is not installed."""
    path = getattr(config, "secret_file", None)
    if path is None:
        return None
    if _crypto() is None:
        raise ConfigError(
            f"{field}.secret_file",
            path,
            "the cryptography package installed (AES-GCM and GMAC)",
            install_hint("secure"),
        )
    secret = read_secret_file(path, f"{field}.secret_file")
    return TierKeys(secret, encrypt=getattr(config, "encrypt", "none") == "aes-gcm")


def _subkey(master: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(purpose, key=master, digest_size=32, person=b"kvtier-subkey-1").digest()


class TierKeys:
    """The keys one secret gives a tier, and what it does with them (any thread).

    ``encrypt``: blocks written are encrypted (reads accept encrypted and MAC-only blocks
    alike: both prove they were written with this secret).
    """

    def __init__(self, secret: bytes, *, encrypt: bool = False):
        crypto = _crypto()
        if crypto is None:
            raise ConfigError(
                "secret_file",
                "(a secret)",
                "the cryptography package installed (AES-GCM and GMAC)",
                install_hint("secure"),
            )
        self._cipher, self._aes, self._gcm, self._aead, self._invalid = crypto
        self.encrypt = encrypt
        # Any length of secret becomes one 64-byte BLAKE2b key; each use gets its own subkey,
        # so a name digest never equals a MAC key's output, whatever the inputs.
        master = hashlib.blake2b(secret, digest_size=64, person=b"kvtier-secret-1").digest()
        self._mac_key = _subkey(master, b"block mac")
        self._enc_key = _subkey(master, b"block encryption")
        self._name_key = _subkey(master, b"value names")
        self._namespace_key = _subkey(master, b"namespace")
        #: 16 bits naming this secret in every block it writes (never 0: 0 is "no id"), so
        #: a reader under another secret reports "other secret" rather than a bad MAC; a
        #: subkey's bits, which tell nothing of the secret
        self.key_id = int.from_bytes(_subkey(master, b"key id")[:2], "big") or 1

    @property
    def flags(self) -> int:
        """The header flags of a block this tier writes."""
        return FLAG_KEYED | (FLAG_ENCRYPTED if self.encrypt else 0)

    def name_digest(self, key: bytes) -> bytes:
        """16 bytes standing for ``key`` where others can see it (value names, headers on the
        shared tier): equal keys, equal digests; nothing about the key without the secret."""
        return hashlib.blake2b(key, key=self._name_key, digest_size=16).digest()

    def namespace(self, layout_digest: bytes) -> str:
        """The default namespace of a tier with this secret and layout: ``kvtier:`` + 16 hex."""
        return "kvtier:" + hashlib.blake2b(layout_digest, key=self._namespace_key, digest_size=8).hexdigest()

    @staticmethod
    def new_salt() -> bytes:
        """A block's random salt (what :func:`encode_header_into` takes as ``salt``)."""
        return os.urandom(SALT_BYTES)

    def _block_key(self, header_view: memoryview, flags: int) -> bytes:
        """The block's own key: a keyed BLAKE2b of its header (all but the tag and the
        header's checksum; the salt makes it unique), so the tag, computed under it, vouches
        for every header field without being fed the header."""
        digest = hashlib.blake2b(
            key=self._enc_key if flags & FLAG_ENCRYPTED else self._mac_key, digest_size=32
        )
        head, tail = mac_parts(header_view)
        digest.update(head)
        digest.update(tail)
        return digest.digest()

    def seal(self, header_page, payload, out=None) -> Any:
        """Tag the block whose header (written with :attr:`flags` and a fresh salt) is in
        ``header_page``, over that header and ``payload``; the payload to store.

        Encrypting, the ciphertext goes into ``out`` (writable, at least ``len(payload)``
        bytes; a new buffer when None) and ``out`` is returned; else ``payload`` itself.
        """
        view = memoryview(header_page)
        flags = header_flags(view)
        key = self._block_key(view, flags)
        if flags & FLAG_ENCRYPTED:
            size = memoryview(payload).nbytes
            result = bytearray(size) if out is None else out
            encryptor = self._cipher(self._aes(key), self._gcm(_GCM_NONCE)).encryptor()
            encryptor.update_into(payload, memoryview(result)[:size])
            encryptor.finalize()
            set_tag(view, encryptor.tag)
            return result
        # GMAC: GCM over no plaintext, the payload as associated data; the one-shot call,
        # cheaper than a streaming context (docs/design/secrets.md#one-shot-gmac)
        set_tag(view, self._aead(key).encrypt(_GCM_NONCE, b"", payload))
        return payload

    def open(self, header_page, header: BlockHeader, payload, source=None) -> str | None:
        """Check a keyed block's tag (``header`` decoded from ``header_page``); decrypt an
        encrypted payload into ``payload`` (writable), from ``source`` when given (else in
        place). ``None`` if it holds, else ``"MAC"`` (a payload that fails is garbage: the
        caller must not serve it)."""
        key = self._block_key(memoryview(header_page), header.flags)
        try:
            if not header.flags & FLAG_ENCRYPTED:
                self._aead(key).decrypt(_GCM_NONCE, header.tag, payload)
                return None
            decryptor = self._cipher(self._aes(key), self._gcm(_GCM_NONCE, header.tag)).decryptor()
            ciphertext = payload if source is None else source
            try:
                decryptor.update_into(ciphertext, payload)
            except ValueError:
                # cryptography < 42 wants 15 spare bytes in the output: decrypt beside, copy back
                memoryview(payload).cast("B")[:] = decryptor.update(ciphertext)
            decryptor.finalize()
        except self._invalid:
            return "MAC"
        return None


def encode_block_header(
    header,
    *,
    layout_digest: bytes,
    key: bytes,
    payload,
    payload_bytes: int,
    keys: TierKeys | None,
    codec: bytes = NO_CODEC,
) -> None:
    """Encode the header of a block whose payload is ``payload`` into ``header`` (a page).

    Without a secret the header carries the payload's xxh3 checksum; with one (``keys``), the
    tier's flags and a fresh salt, and its tag is set afterwards by :meth:`TierKeys.seal`.
    ``key`` is what the header names: the offload key, or on a shared tier its keyed digest.
    ``codec``: the descriptor of the codec ``payload`` is encoded with.
    """
    if keys is None:
        encode_header_into(
            header,
            layout_digest=layout_digest,
            key=key,
            payload_bytes=payload_bytes,
            checksum=xxhash.xxh3_64_intdigest(payload),
            codec=codec,
        )
    else:
        encode_header_into(
            header,
            layout_digest=layout_digest,
            key=key,
            payload_bytes=payload_bytes,
            checksum=0,
            flags=keys.flags,
            salt=keys.new_salt(),
            key_id=keys.key_id,
            codec=codec,
        )
