"""Kernels that take the worker process down or never return; each must become one ERROR row."""

from __future__ import annotations

import os
import time


def aborts(q, k, v, *, causal: bool, softmax_scale: float):
    os.abort()  # SIGABRT, like a failed assertion in C++ code


def exits(q, k, v, *, causal: bool, softmax_scale: float):
    os._exit(9)  # the process vanishes without a Python traceback


def hangs(q, k, v, *, causal: bool, softmax_scale: float):
    time.sleep(60)  # far past any --timeout the tests give
    raise AssertionError("the worker should have been killed by now")
