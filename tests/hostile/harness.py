"""Run many `qkv` command lines, each in its own forked process under a memory and time limit.

    python harness.py cases.json results.json

cases.json: [{"id": ..., "argv": [...], "cwd": ..., "env": {...}, "file_size_limit": bytes}, ...]
(env and file_size_limit optional; an env value of null removes the variable). The parent imports qkv and torch
once (about 2-4 s) and forks one child per case, so a case costs milliseconds of start-up.
Each child gets RLIMIT_AS = the parent's address space + LIMIT_BYTES (what it may allocate
on top of torch), one thread, and an audit hook that records any Python-level open of a
path under SENTINEL_DIR (native opens are caught by FIFOs there: opening one blocks, and the
case runs out of time). results.json: per case the exit code, stdout, stderr, wall seconds,
peak resident memory and the sentinel paths opened.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

LIMIT_BYTES = int(os.environ.get("QKV_HOSTILE_LIMIT_BYTES", str(1 << 30)))
TIME_LIMIT = float(os.environ.get("QKV_HOSTILE_TIME_LIMIT", "20"))


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _child(case: dict, out_path: str, err_path: str, sentinel_dir: str, opened_path: str) -> None:
    import torch

    from qkv.cli.main import main

    torch.set_num_threads(1)
    os.chdir(case.get("cwd") or os.getcwd())
    for name, value in case.get("env", {}).items():  # a case's own environment (cache folders)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    sentinel_dir = os.path.realpath(sentinel_dir)

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if os.path.realpath(path).startswith(sentinel_dir + os.sep):
                with open(opened_path, "a", encoding="utf-8") as handle:  # noqa: PTH123 (re-enters the hook once)
                    handle.write(path + "\n")

    sys.addaudithook(audit)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + LIMIT_BYTES, resource.RLIM_INFINITY))
    if case.get("file_size_limit"):  # writes past it fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (case["file_size_limit"], resource.RLIM_INFINITY))
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    try:
        code = main(case["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def main() -> None:
    cases_path, results_path, sentinel_dir, work = sys.argv[1:5]
    with open(cases_path, encoding="utf-8") as handle:
        cases = json.load(handle)
    import torch  # noqa: F401  (imported once, shared by every forked case)

    import qkv.chat.conversation  # noqa: F401
    import qkv.cli.main  # noqa: F401
    import qkv.models.loader  # noqa: F401
    import qkv.training.loop  # noqa: F401

    results = []
    for index, case in enumerate(cases):
        out_path, err_path = f"{work}/{index}.out", f"{work}/{index}.err"
        opened_path = f"{work}/{index}.opened"
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(case, out_path, err_path, sentinel_dir, opened_path)
        timed_out = False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > TIME_LIMIT:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                timed_out = True
                break
            time.sleep(0.01)
        seconds = time.monotonic() - start
        code = os.waitstatus_to_exitcode(status)
        opened = open(opened_path, encoding="utf-8").read().split() if os.path.exists(opened_path) else []
        results.append({
            "id": case["id"], "code": code, "timed_out": timed_out, "seconds": seconds,
            "max_rss": usage.ru_maxrss * 1024,
            "stdout": open(out_path, encoding="utf-8", errors="replace").read(),
            "stderr": open(err_path, encoding="utf-8", errors="replace").read(),
            "opened": opened,
        })
    with open(results_path, "w", encoding="utf-8") as handle:
        json.dump({"parent_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "results": results}, handle)


if __name__ == "__main__":
    main()
