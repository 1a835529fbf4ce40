from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest

from blazar.config import KeyConfig
from blazar.gateway.errors import Forbidden
from blazar.web.auth import check_admin, keys_from_env
from blazar.web.client import context_of


class FakeRequest:
    def __init__(
        self, host: str, key: Any = None, keys_active: bool = False, headers: dict[bytes, bytes] | None = None
    ) -> None:
        self.host = host
        self.headers = headers or {}
        context_of(self).key = key
        context_of(self).keys_active = keys_active

    def getClientAddress(self) -> Any:
        return type("Addr", (), {"host": self.host})()

    def getHeader(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class AuthHelperTests(SynchronousTestCase):
    def test_keys_from_env(self) -> None:
        keys = keys_from_env("a:0123456789abcdef, b:fedcba9876543210")
        self.assertEqual([(k.name, k.admin) for k in keys], [("a", True), ("b", True)])
        self.assertEqual(keys_from_env(None), ())
        for bad in ("nocolon", "a:short", ":0123456789abcdef"):
            with self.assertRaises(ValueError):
                keys_from_env(bad)

    def test_keyless_management_only_from_loopback(self) -> None:
        check_admin(cast(IRequest, FakeRequest("127.0.0.1")), "pull models")
        with self.assertRaises(Forbidden) as cm:
            check_admin(cast(IRequest, FakeRequest("10.1.2.3")), "pull models")
        self.assertIn("blazar keys add", str(cm.exception))
        scoped = KeyConfig("s", "x" * 16, models=("m:latest",))
        with self.assertRaises(Forbidden):
            check_admin(cast(IRequest, FakeRequest("127.0.0.1", scoped, True)), "pull models")
        check_admin(cast(IRequest, FakeRequest("10.1.2.3", KeyConfig("a", "y" * 16), True)), "pull models")
        # from loopback, but a page of another site (cross-site request forgery): refused
        with self.assertRaises(Forbidden):
            check_admin(
                cast(IRequest, FakeRequest("127.0.0.1", headers={b"origin": b"https://evil.example"})), "pull models"
            )
        check_admin(
            cast(IRequest, FakeRequest("127.0.0.1", headers={b"origin": b"http://localhost:11434"})), "pull models"
        )
