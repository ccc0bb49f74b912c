"""CURVE authentication and encryption of the zmq connector's sockets (keys from its settings).

Every instance has a CURVE key pair (``curve_secret_key``; the public key follows from it) and
trusts a set of public keys: its own and ``curve_peer_keys``. A deployment may give every
instance the same key pair, or each its own and list the others' public keys. An instance's
address carries its public key (``tcp://host:port;curve=<hex>``), so a sender knows the key the
receiver must prove it holds; a sender connects only to an address whose key it trusts.

On the receiving side a ZAP handler (a thread) refuses, at the handshake, every client whose key
is not trusted: its messages never reach the inbox. A message's sender is the address its DEALER
declares (its routing id); it is believed only when the key in that address is the key the
connection authenticated with, so a peer cannot make this instance answer to another address.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import zmq
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from pydantic import SecretStr

#: What separates the zmq endpoint from the public key in an address.
KEY_IN_ADDRESS: Final = ";curve="


def check_key(value: str, what: str) -> str:
    """``value`` if it is a Z85-encoded CURVE key (40 characters); the error does not show it."""
    try:
        ok = len(value) == 40 and len(zmq.utils.z85.decode(value)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise ValueError(f"{what} is not a Z85 CURVE key (40 characters; make a pair with "
                         "python -c 'import zmq; print(zmq.curve_keypair())')")
    return value


def split_address(address: str) -> tuple[str, bytes | None]:
    """The zmq endpoint of ``address`` and the Z85 public key it carries (None: none)."""
    endpoint, _, key = address.partition(KEY_IN_ADDRESS)
    if not key:
        return endpoint, None
    try:
        return endpoint, zmq.utils.z85.encode(binascii.unhexlify(key))
    except (binascii.Error, ValueError):
        return endpoint, b"?"   # a key no one holds


@dataclass(frozen=True, slots=True)
class Curve:
    """This instance's key pair and the public keys it trusts (all Z85)."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def from_settings(cls, secret_key: SecretStr | None, peer_keys: list[str]) -> Curve | None:
        """The keys the settings give, or None when ``curve_secret_key`` is unset (no CURVE)."""
        if secret_key is None:
            return None
        secret = secret_key.get_secret_value().encode()
        public = zmq.curve_public(secret)
        return cls(public, secret, frozenset({public, *(key.encode() for key in peer_keys)}))

    def address(self, endpoint: str) -> str:
        """The address to publish for ``endpoint``: it carries this instance's public key."""
        return f"{endpoint}{KEY_IN_ADDRESS}{zmq.utils.z85.decode(self.public).hex()}"

    def serve(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` (the inbox, before it binds) a CURVE server."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def connect_as_client(self, socket: zmq.Socket[bytes], server_key: bytes) -> None:
        """Make ``socket`` (a DEALER, before it connects) a CURVE client of a server with ``server_key``."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = server_key

    def authenticator(self, context: zmq.Context[zmq.Socket[bytes]]) -> ThreadAuthenticator:
        """The started ZAP handler of ``context``: it lets in only the trusted keys."""
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", credentials_provider=self)
        return authenticator

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question: may a client with public ``key`` connect?"""
        return key in self.trusted

    def sent_by(self, sender: str, authenticated_key: str | None) -> bool:
        """Whether ``sender`` (the address a message declares) is the peer its connection authenticated."""
        return authenticated_key is not None and split_address(sender)[1] == authenticated_key.encode()
