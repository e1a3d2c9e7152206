"""Several models per agent (issue 32): a profile lists `models`, `session/model` sets the model of a session's next
calls durably (a restart keeps it), and each call's trace record says which model it named. End to end against the
real daemon and the stand-in model server."""

from __future__ import annotations

from pathlib import Path

import pytest

from devd import errors
from devd.agent.profiles import parse_profiles
from tests.agents import run_turn, start
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.test_agent_limits import _traced, agentd

__all__ = ["standin_fixture"]

MODELS = '["standin-model", "standin-large"]'


def test_models_without_model_make_the_first_the_default_and_a_model_apart_is_offered_too(tmp_path: Path) -> None:
    head = f'base_url = "http://h/v1"\nworkspace_roots = ["{tmp_path}"]\n'
    listed = parse_profiles(f'[agent.a]\n{head}models = ["x", "y"]\n', "FILE")["a"]
    apart = parse_profiles(f'[agent.a]\n{head}model = "z"\nmodels = ["x", "y"]\n', "FILE")["a"]
    assert ((listed.model, listed.models), (apart.model, apart.models)) == (("x", ("x", "y")), ("z", ("z", "x", "y")))


def test_a_profile_with_neither_model_nor_models_is_refused_saying_what_to_add(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        parse_profiles(f'[agent.a]\nbase_url = "http://h/v1"\nworkspace_roots = ["{tmp_path}"]\n', "FILE")
    assert str(refused.value) == "FILE:1: [agent.a] has no model; add model = a string (or models = [...])"


def test_session_model_sets_the_model_of_the_next_calls_and_the_trace_says_each(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="small"), Scripted(text="large"))
    with agentd(tmp_path, standin, monkeypatch, models=MODELS) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "one")
        chosen = c.call("session/model", {"session": session, "model": "standin-large"})
        run_turn(c, session, "two")
        records = _traced(c, session, 2)
    assert (chosen, [r.body["model"] for r in standin.requests], [r["model"] for r in records]) == (
        {"model": "standin-large", "models": ["standin-model", "standin-large"]},
        ["standin-model", "standin-large"],
        ["standin-model", "standin-large"],
    )


def test_a_model_the_profile_does_not_offer_is_refused_naming_those_it_does(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with agentd(tmp_path, standin, monkeypatch, models=MODELS) as d, d.client() as c:
        session = d.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.call("session/model", {"session": session, "model": "gpt-9"})
    assert str(refused.value) == (
        "agent 'coder' offers no model 'gpt-9'; its models are standin-model, standin-large (add it to models in the "
        "agents file and restart the daemon)"
    )


def test_the_model_set_survives_a_restart(tmp_path: Path, standin: Standin) -> None:
    agentd = start(tmp_path, standin, models=MODELS)
    standin.script(Scripted(text="after the restart"))
    with agentd.daemon:
        with agentd.client() as c:
            session = agentd.session(c)
            c.call("session/model", {"session": session, "model": "standin-large"})
        agentd.daemon.stop()
        agentd.daemon.start()
        with agentd.client() as c:
            run_turn(c, session, "hello")
    assert standin.requests[0].body["model"] == "standin-large"
