"""
Typed views, for mypy, of test helpers whose types it cannot see.

L{TestCaseMixin}: a mixin that holds assertions (a contract run against a
fake and the real object, shared expectations, a shared C{setUp}) calls
C{self.assertEqual}, C{self.successResultOf} and friends, which exist only
once it is mixed into a L{SynchronousTestCase}. Deriving the mixin from
L{TestCaseMixin} lets mypy check those calls while, at run time, the mixin
stays a plain object, so the runner collects only the concrete test cases.

L{StubTreq}: treq's C{StubTreq} sets its request methods in C{__init__}
with C{setattr}, so mypy sees none of them; this is the same class at run
time, with those methods declared for mypy.

L{not_none}: an optional value narrowed inside an expression.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")


def not_none(value: T | None) -> T:
    """
    C{value}, which must not be C{None}: narrows an optional result within
    an expression (an assertion on a field of what a lookup found).
    """
    assert value is not None
    return value


if TYPE_CHECKING:
    from treq.response import _Response
    from treq.testing import StubTreq as _StubTreq
    from twisted.internet.defer import Deferred
    from twisted.trial.unittest import SynchronousTestCase

    TestCaseMixin = SynchronousTestCase

    class StubTreq(_StubTreq):
        def request(self, method: str, url: str, **kwargs: Any) -> Deferred[_Response]: ...
        def get(self, url: str, **kwargs: Any) -> Deferred[_Response]: ...
        def head(self, url: str, **kwargs: Any) -> Deferred[_Response]: ...
        def delete(self, url: str, **kwargs: Any) -> Deferred[_Response]: ...
        def post(self, url: str, data: Any = None, **kwargs: Any) -> Deferred[_Response]: ...
        def put(self, url: str, data: Any = None, **kwargs: Any) -> Deferred[_Response]: ...
        def patch(self, url: str, data: Any = None, **kwargs: Any) -> Deferred[_Response]: ...

else:
    from treq.testing import StubTreq

    TestCaseMixin = object

__all__ = ["StubTreq", "TestCaseMixin", "not_none"]
