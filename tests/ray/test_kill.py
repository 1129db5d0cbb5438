"""`deploy.ray.controller.kill` returns only once Ray reports each killed actor dead.

`ray.kill` only asks: for a while after it the control store still lists the actor, and a
`down` that returned then left a name a new deploy was refused (CI saw it). Whether a real Ray
is slow enough to show that is up to the host, so here Ray's answers are scripted: each actor
answers "alive" (or "unreachable", or a timeout) a few times after the kill, then "dead"."""

from __future__ import annotations

import logging

import pytest
import ray

from deploy.ray import controller


class _Ready:
    """An actor's `__ray_ready__` method: `.remote()` returns a ref to what it answers next."""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def remote(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class _Actor:
    def __init__(self, name: str, answers: list) -> None:
        self.name, self.killed = name, False
        self.__ray_ready__ = _Ready(answers)

    def __repr__(self) -> str:
        return self.name


def _dead() -> Exception:
    return ray.exceptions.RayActorError()


@pytest.fixture
def scripted(monkeypatch):
    """Ray's kill and get, answering from each actor's script; returns the calls made."""
    calls: list[str] = []

    def kill(actor, no_restart: bool) -> None:
        assert no_restart
        actor.killed = True
        calls.append(f"kill {actor}")

    def get(answer, timeout: float):
        assert timeout > 0
        calls.append(f"get {answer!r}")
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(controller.ray, "kill", kill)
    monkeypatch.setattr(controller.ray, "get", get)
    monkeypatch.setattr(controller.time, "sleep", lambda s: None)
    return calls


def test_kill_waits_until_every_actor_is_reported_dead(scripted) -> None:
    unreachable = ray.exceptions.ActorUnavailableError("restarting", None)
    slow = _Actor("slow", [None, None, unreachable, ray.exceptions.GetTimeoutError(), _dead()])
    quick = _Actor("quick", [_dead()])
    controller.kill([slow, quick])
    assert slow.killed and quick.killed
    assert scripted[:2] == ["kill slow", "kill quick"]  # all asked first, then awaited
    gets = scripted[2:]
    # The slow one was asked until its fifth answer (dead), and only then the quick one.
    assert len(gets) == 6 and "RayActorError" in gets[4] and "RayActorError" in gets[5]


def test_kill_gives_up_after_its_timeout_and_says_so(scripted, monkeypatch, caplog) -> None:
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0  # every look at the clock: a second later
        return t[0]

    monkeypatch.setattr(controller.time, "monotonic", clock)
    stuck = _Actor("stuck", [None])  # alive, whatever it is asked
    with caplog.at_level(logging.WARNING, logger=controller.__name__):
        controller.kill([stuck], timeout_s=5.0)
    assert "still alive 5 s after kill" in caplog.text
    assert 1 < len([c for c in scripted if c.startswith("get")]) < 10
