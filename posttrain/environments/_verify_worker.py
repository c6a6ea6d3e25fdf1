"""Child process of `math_env.VerifierPool`: grade `(ground_truth, answer)` pairs with math-verify.

Run as a script by path (`python _verify_worker.py FD`), not imported: that keeps torch and the
rest of posttrain out of the child (fast start, small memory) and avoids multiprocessing's
re-import of the parent's `__main__`, which breaks scripts without an `if __name__` guard.
It talks over the socket whose file descriptor is FD (a `multiprocessing.connection.Connection`):
it sends "ready" once math-verify is imported, then one float (1.0 / 0.0) per received pair, and
exits when the parent closes the socket. Its timeouts are off: the parent enforces them by
killing this process (math-verify's own timeout needs `signal.alarm` in the main thread and
cannot interrupt long C-level work such as sympy evaluating `9^{9^{9^9}}`).
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection


def as_latex_answer(answer: str) -> str:
    """Box an answer so math-verify's LaTeX extractor reads the whole string as one answer.

    Its expression extractor still handles plain text such as "1/2" or "0.5".
    """
    return answer if "\\boxed" in answer else "\\boxed{" + answer + "}"


def serve(conn: Connection) -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    conn.send("ready")
    while True:
        try:
            ground_truth, answer = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            gold = parse(as_latex_answer(ground_truth), extraction_config=extraction, parsing_timeout=None)
            pred = parse(as_latex_answer(answer), extraction_config=extraction, parsing_timeout=None)
            correct = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
        except Exception:  # anything math-verify or sympy raises on odd input is a wrong answer
            correct = False
        conn.send(1.0 if correct else 0.0)


if __name__ == "__main__":
    sys.path.pop(0)  # this script's folder: its module names must not shadow real packages
    serve(Connection(int(sys.argv[1])))
