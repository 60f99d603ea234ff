"""The examples in the public entry points' docstrings run and print what they say."""

import doctest

import pytest
import torch
from torch import nn

import mirrorgrad
from mirrorgrad import compiler, options
from mirrorgrad.nn import cells, rnn

ENTRY_POINTS = [
    compiler.compile,
    compiler.explain,
    options.MirrorOptions,
    rnn.LSTM,
    rnn.GRU,
    rnn.RNN,
    rnn.convert,
    cells.LSTMCell,
    cells.GRUCell,
    cells.RNNCell,
]


@pytest.mark.parametrize("obj", ENTRY_POINTS, ids=lambda obj: obj.__qualname__)
def test_docstring_example_runs(obj):
    globs = {
        "torch": torch,
        "nn": nn,
        "mirrorgrad": mirrorgrad,
        "MirrorOptions": options.MirrorOptions,
    }
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__qualname__, globs=globs)
    examples = sum(len(t.examples) for t in tests)
    assert examples > 0, f"{obj.__qualname__}'s docstring has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
