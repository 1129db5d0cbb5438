"""The producer's book of transfers, without sockets: states, the one exit, and vLLM's blocks."""

from __future__ import annotations

import time

import pytest

from splitserve.kv.ticket import TransferId
from splitserve.kv.transfers import Refused, TransferBook, TransferState

T = TransferId


def test_states_are_ordered_and_final_from_sent_on() -> None:
    s = TransferState
    assert s.HELD < s.CLAIMED < s.SENT < s.RELEASED < s.EXPIRED < s.FAILED
    assert [x for x in s if x.live] == [s.HELD, s.CLAIMED]


def test_pull_path_returns_blocks_once_and_ends_sent() -> None:
    book = TransferBook(lease_s=60)
    book.hold(T("t"), "req-t", [3, 4])
    assert book.take_finished() == set()  # vLLM's blocks are still ours
    t = book.claim(T("t"), [4], wait_s=0)
    assert t.state is TransferState.CLAIMED and book.status()["claimed"] == 1
    book.gathered(t)
    assert book.take_finished() == {"req-t"}  # copied: vLLM may reuse them during the send
    book.finish(t, ok=True)
    assert book.take_finished() == set()  # reported once, not again at the end
    status = book.status()
    assert (status["held"], status["claimed"], status["sent"], status["held_blocks"]) == (
        0, 0, 1, 0)


def test_copy_out_returns_blocks_at_the_hold() -> None:
    book = TransferBook(lease_s=60)
    book.hold(T("t"), "req-t", [1], snapshot=object())
    assert book.take_finished() == {"req-t"}
    assert book.status()["held"] == 1  # the copy is still held for the consumer


def test_release_ends_a_held_transfer_but_not_one_being_sent() -> None:
    book = TransferBook(lease_s=60)
    book.hold(T("a"), "ra", [1])
    book.hold(T("b"), "rb", [2])
    assert book.release(T("a")) is TransferState.HELD
    claimed = book.claim(T("b"), [2], wait_s=0)
    assert book.release(T("b")) is TransferState.CLAIMED  # mid-send: it ends on its own
    book.finish(claimed, ok=False)
    assert book.take_finished() == {"ra", "rb"}
    assert book.release(T("a")) is TransferState.RELEASED  # remembered, idempotent
    assert book.release(T("b")) is TransferState.FAILED
    with pytest.raises(Refused, match="released"):
        book.claim(T("a"), [1], wait_s=0)


def test_a_release_before_the_hold_frees_it_when_it_comes() -> None:
    book = TransferBook(lease_s=60)
    assert book.release(T("early")) is None
    book.hold(T("early"), "r", [5, 6])
    assert book.take_finished() == {"r"}
    assert book.status()["held"] == 0 and book.status()["released"] == 1


def test_an_id_used_twice_does_not_lose_the_first_hold() -> None:
    book = TransferBook(lease_s=60)
    book.hold(T("dup"), "first", [1])
    book.hold(T("dup"), "second", [2])
    assert book.take_finished() == {"second"}  # the newcomer's blocks go back at once
    assert book.claim(T("dup"), [1], wait_s=0).req_id == "first"


def test_lease_expiry_frees_and_a_late_pull_is_told_why() -> None:
    expired = []
    book = TransferBook(lease_s=0.05)
    book.on_expired = expired.append
    book.hold(T("t"), "r", [1])
    time.sleep(0.1)
    assert book.take_finished() == {"r"} and len(expired) == 1
    with pytest.raises(Refused, match="lease expired"):
        book.claim(T("t"), [1], wait_s=0)
    assert book.status()["expired"] == 1


def test_claim_of_foreign_blocks_is_refused_and_frees_the_transfer() -> None:
    book = TransferBook(lease_s=60)
    book.hold(T("t"), "r", [1, 2])
    with pytest.raises(Refused, match="not among the held"):
        book.claim(T("t"), [9], wait_s=0)
    assert book.take_finished() == {"r"} and book.status()["released"] == 1


def test_unknown_transfer_is_refused_after_the_wait() -> None:
    book = TransferBook(lease_s=60)
    with pytest.raises(Refused, match="unknown"):
        book.claim(T("nope"), [1], wait_s=0.05)


def test_the_board_shows_every_change_to_another_reader(tmp_path) -> None:
    """What the worker server reads (board.py) follows the book without being asked."""
    from splitserve.kv.board import BoardWriter, read_board

    path = tmp_path / "p.kvboard"
    assert read_board(path) == {}
    book = TransferBook(lease_s=60)
    book.on_change = BoardWriter(path).publish
    book.hold(T("a"), "ra", [1, 2, 3])
    assert read_board(path)["held"] == 1 and read_board(path)["held_blocks"] == 3
    t = book.claim(T("a"), [1], wait_s=0)
    assert read_board(path)["claimed"] == 1
    book.finish(t, ok=True)
    assert read_board(path) == book.status() and read_board(path)["sent"] == 1
