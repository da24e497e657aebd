"""The engine core's channel: a read on an end that another thread closed ends as EOFError, the
way the receiver thread stops, never as an exception of the closed connection's internals."""

from __future__ import annotations

import multiprocessing

import pytest

from graphkeeper.worker.engine.ipc import Channel


def test_a_read_that_finds_its_end_closed_under_it_reads_as_the_end():
    """The receiver thread passed the connection's closed check, then another thread closed the
    channel (the worker exiting after a failed bind): the read finds no handle. Reproduced here
    by closing first and skipping the check the receiver had already passed."""
    here, there = multiprocessing.Pipe()
    channel = Channel(here)
    channel.close()
    here._check_closed = lambda: None  # the check the blocked reader had passed before the close
    with pytest.raises(EOFError):
        channel.recv()
    there.close()


def test_messages_still_arrive_in_order():
    here, there = multiprocessing.Pipe()
    a, b = Channel(here), Channel(there)
    a.send([1, "two"])
    assert b.recv() == [1, "two"]
    a.close()
    with pytest.raises(EOFError):
        b.recv()
