from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import KeyConfig
from blazar.web.auth import Forbidden, check_admin, keys_from_env


class FakeRequest:
    def __init__(self, host: str, key: Any = None, keys_active: bool = False) -> None:
        self.host = host
        self.blazar_key = key
        self.blazar_keys_active = keys_active

    def getClientAddress(self) -> Any:
        return type("Addr", (), {"host": self.host})()


class AuthHelperTests(SynchronousTestCase):
    def test_keys_from_env(self) -> None:
        keys = keys_from_env("a:0123456789abcdef, b:fedcba9876543210")
        self.assertEqual([(k.name, k.admin) for k in keys], [("a", True), ("b", True)])
        self.assertEqual(keys_from_env(None), ())
        for bad in ("nocolon", "a:short", ":0123456789abcdef"):
            with self.assertRaises(ValueError):
                keys_from_env(bad)

    def test_keyless_management_only_from_loopback(self) -> None:
        check_admin(FakeRequest("127.0.0.1"), "pull models")  # type: ignore[arg-type]
        with self.assertRaises(Forbidden) as cm:
            check_admin(FakeRequest("10.1.2.3"), "pull models")  # type: ignore[arg-type]
        self.assertIn("blazar keys add", str(cm.exception))
        scoped = KeyConfig("s", "x" * 16, models=("m:latest",))
        with self.assertRaises(Forbidden):
            check_admin(FakeRequest("127.0.0.1", scoped, True), "pull models")  # type: ignore[arg-type]
        check_admin(FakeRequest("10.1.2.3", KeyConfig("a", "y" * 16), True), "pull models")  # type: ignore[arg-type]


class ScopeOrderTests(SynchronousTestCase):
    def test_scope_before_rates_and_rates_once(self) -> None:
        from blazar.web.auth import check_scope
        from blazar.web.quota import QuotaExceeded

        calls: list[int] = []

        def rates() -> None:
            calls.append(1)
            raise QuotaExceeded("over", 5)

        request = FakeRequest("127.0.0.1", KeyConfig("s", "x" * 16, models=("a:latest",)), True)
        request.blazar_rates = rates  # type: ignore[attr-defined]
        with self.assertRaises(Forbidden):
            check_scope(request, "b:latest")  # type: ignore[arg-type]
        self.assertEqual(calls, [])
        with self.assertRaises(QuotaExceeded):
            check_scope(request, "a:latest")  # type: ignore[arg-type]
        check_scope(request, "a:latest")  # type: ignore[arg-type]  # counted once per request
        self.assertEqual(calls, [1])
