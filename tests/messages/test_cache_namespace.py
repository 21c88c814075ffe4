"""The prompt-cache namespace of a request: ``cache_namespace`` and the fields that feed it."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from messages.gateway import Generate, GenerationParams
from messages.prompt_cache import CACHE_SALT_MAX_CHARS, cache_namespace

_value = st.none() | st.text(min_size=1, max_size=40)


def test_no_salt_and_no_scope_is_the_base_namespace() -> None:
    """Without a salt or scope every client shares the base namespace (adapters keep theirs)."""
    assert cache_namespace() == ""
    assert cache_namespace(base="adapter-x") == "adapter-x"
    assert GenerationParams().cache_namespace == ""


@given(_value, _value, _value, _value)
def test_namespaces_are_equal_exactly_when_scope_and_salt_are(
    salt_a: str | None, scope_a: str | None, salt_b: str | None, scope_b: str | None
) -> None:
    """Two (scope, salt) pairs give the same namespace iff they are the same pair."""
    same = (salt_a, scope_a) == (salt_b, scope_b)
    assert (cache_namespace(salt_a, scope_a) == cache_namespace(salt_b, scope_b)) == same


def test_salt_and_scope_are_not_interchangeable_and_fields_do_not_run_together() -> None:
    """A salt never lands in the namespace of the same string used as a scope, and the
    length prefix keeps ("ab", "c") apart from ("a", "bc")."""
    assert cache_namespace("x", None) != cache_namespace(None, "x")
    assert cache_namespace("c", "ab") != cache_namespace("bc", "a")


def test_the_namespace_holds_a_digest_never_the_salt() -> None:
    """The salt (a secret of the client) is not readable from the namespace (it goes into
    SSD file headers and traces); the digest is fixed across processes (golden value)."""
    ns = cache_namespace("my-secret-salt")
    assert "my-secret-salt" not in ns
    assert ns == "#iso:" + ns.removeprefix("#iso:")
    assert len(ns.removeprefix("#iso:")) == 32
    # The documented construction: domain, then scope and salt length-prefixed (None: 0x00).
    spec = b"kvtier.cache-namespace.v1\x00" + b"\x00" + b"\x01" + (1).to_bytes(4, "big") + b"a"
    assert cache_namespace("a") == "#iso:" + hashlib.sha256(spec).hexdigest()[:32]


def test_any_python_string_has_a_namespace() -> None:
    """A salt holding a lone surrogate (an embedder's string; JSON cannot carry one) still
    gets a namespace of its own instead of an encoding error at admission."""
    assert cache_namespace("\ud800") not in (cache_namespace("\ud801"), cache_namespace("?"))


@pytest.mark.parametrize("salt", ["", "x" * (CACHE_SALT_MAX_CHARS + 1)])
def test_generation_params_refuse_an_empty_or_overlong_salt(salt: str) -> None:
    """cache_salt is a non-empty string of at most 256 characters (vLLM's meaning, bounded)."""
    with pytest.raises(ValidationError, match="cache_salt"):
        GenerationParams(cache_salt=salt)
    assert GenerationParams(cache_salt="x" * CACHE_SALT_MAX_CHARS).cache_salt is not None


def test_generate_refuses_a_namespace_that_drops_the_salt() -> None:
    """A Generate whose params carry a salt must name the salted namespace: admitting it
    under the shared namespace would let it meet every other client's prefixes."""
    salted = GenerationParams(cache_salt="s")
    with pytest.raises(ValidationError, match="namespace"):
        Generate(request_id="r", prompt_tokens=(1, 2), params=salted)
    ok = Generate(request_id="r", prompt_tokens=(1, 2), params=salted,
                  namespace=salted.cache_namespace)
    assert Generate.model_validate_json(ok.model_dump_json()) == ok
