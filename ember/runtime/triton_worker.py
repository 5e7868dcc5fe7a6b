"""A compile worker of the Triton compile pool (Note: the compile pool, runtime/triton_pool.py):
`python -m ember.runtime.triton_worker`, started by the pool.

Reads (`CompileRequest`, build the C launcher too) pairs from stdin, compiles each into
Triton's on-disk cache (runtime/triton_compile.py `compile_in_worker`) and answers ("ok", a
note) or ("error", the error in words) on its stdout, one message per request, until stdin
ends. Anything else that writes to stdout (Triton's or ptxas's messages) is sent to stderr, so it
can never corrupt an answer.
"""

from __future__ import annotations

import os
import sys

from ember.runtime.triton_compile import compile_in_worker
from ember.runtime.triton_pool import read_message, write_message


def main() -> None:
    import triton.compiler  # noqa: F401  (paid once, before the first request: the pool starts workers early)

    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while (job := read_message(requests)) is not None:
        request, build_launcher = job
        try:
            answer = ("ok", compile_in_worker(request, build_launcher))
        except Exception as e:  # reported to the launcher, which compiles it itself
            answer = ("error", f"{type(e).__name__}: {e}")
        write_message(answers, answer)


if __name__ == "__main__":
    main()
