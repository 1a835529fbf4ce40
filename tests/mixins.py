"""
A typed base for test mixins.

A mixin that holds assertions (a contract run against a fake and the real
object, shared expectations, shared C{setUp}) calls C{self.assertEqual},
C{self.successResultOf} and friends, which exist only once it is mixed into
a L{SynchronousTestCase}. Deriving the mixin from L{TestCaseMixin} lets mypy
check those calls while, at run time, the mixin stays a plain object, so
the runner collects only the concrete test cases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twisted.trial.unittest import SynchronousTestCase

    TestCaseMixin = SynchronousTestCase
else:
    TestCaseMixin = object
