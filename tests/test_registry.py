"""dgc.registry: the one mechanism behind compressors, exchanges, task families and models."""

from __future__ import annotations

import pytest
from dgc.tasks import TASK_KINDS
from dgc.tasks.models import MODELS

import dgc
from dgc.exchanges import EXCHANGES
from dgc.registry import Registry


def test_every_family_uses_the_registry_and_names_the_valid_entries():
    cases = [(dgc.COMPRESSORS, "compressor"), (EXCHANGES, "exchange"), (TASK_KINDS, "task kind"), (MODELS, "model")]
    for registry, kind in cases:
        assert isinstance(registry, Registry) and registry.kind == kind
        with pytest.raises(ValueError) as err:
            registry.pick("nope")
        assert str(err.value) == f"unknown {kind} 'nope'; valid: {', '.join(registry)}"
    assert list(EXCHANGES) == ["flat", "densify", "hierarchical", "sparse_allreduce"]
    assert {"image", "language", "speech", "causal_lm"} == set(TASK_KINDS)


def test_register_by_name_attribute_and_refuse_a_second_entry_of_the_same_name():
    reg: Registry[type] = Registry("widget")

    @reg.register
    class A:
        name = "a"

    assert reg.pick("a") is A and "a" in reg and len(reg) == 1
    assert reg.register(A) is A  # the same entry again is fine
    with pytest.raises(TypeError, match="two widgets are named 'a'"):
        reg.add("a", object())


def test_a_lazy_entry_is_imported_on_first_use():
    reg: Registry[object] = Registry("thing")
    reg.lazy("dumps", "json:dumps")
    assert list(reg) == ["dumps"]
    import json

    assert reg.pick("dumps") is json.dumps
    reg.lazy("missing", "json:no_such_attribute")
    with pytest.raises(AttributeError):
        reg.pick("missing")
