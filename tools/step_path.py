"""Where one training step's data goes: the stage files of `mrl/train/` that step 1 of a job enters,
in order, from `train_step` to the `publish` of the weights it made (issue 42, item 4: "count the
file changes along the call trace").

    python tools/step_path.py [JOB] [key=value ...]    (default: the quickstart, one plain process)

The place of a moment is the innermost frame's file in `mrl/train/`, leaving out the bookkeeping
every stage touches (`timer.py`; `parts.py` and `groups.py`, plain data); what a stage calls
outside `mrl/train/` (the engine, the rewards, `Batch`) stays in its place. An entry is a call that moves to another place (a return
to the caller is not one); a re-entry enters a place entered before. A loop that enters a place
once per prompt is one entry site (the calling line), so the path a reader follows is the list of
entry sites. Prints each entry (`caller:line -> place`) in order, then
`places P entries E (sites S) re-entries R (sites T)`.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "mrl" / "train") + "/"
BOOKKEEPING = {TRAIN + "timer.py", TRAIN + "parts.py", TRAIN + "groups.py"}


def place_of(frame):
    """(file, frame) of the innermost stage frame at or above `frame`, or (None, None)."""
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith(TRAIN) and f not in BOOKKEEPING:
            return f, frame
        frame = frame.f_back
    return None, None


class PathTrace:
    """`sys.setprofile` hook: the entries of stage places, as (caller file:line, place)."""

    def __init__(self):
        self.current: str | None = None
        self.entries: list[tuple[str, str]] = []

    def __call__(self, frame, event, arg):
        if event == "call":
            where, at = place_of(frame)
            if where is not None and where != self.current:
                caller, by = place_of(at.f_back)   # the calling stage frame (through contextlib & co.)
                site = f"{short(caller)}:{by.f_lineno}" if caller else "-"
                self.entries.append((site, short(where)))
                self.current = where
        elif event == "return":
            where, _ = place_of(frame.f_back)
            if where is not None:
                self.current = where

    def summary(self) -> dict[str, int]:
        places = {p for _, p in self.entries}
        sites = set(self.entries)
        return {"places": len(places), "entries": len(self.entries), "sites": len(sites),
                "re-entries": len(self.entries) - len(places), "re-entry sites": len(sites) - len(places)}


def short(path: str) -> str:
    return path[len(str(REPO)) + 1:]


def step_path(job: str = "jobs/quickstart_cpu.toml", overrides: tuple[str, ...] = (),
              out: str | None = None) -> PathTrace:
    """The entries of step 1 of `job` (one plain process, one step, no checkpoint, no tracking;
    `overrides` on top), traced from `train_step` to the `publish` of the weights it made."""
    sys.path.insert(0, str(REPO))
    import mrl.train.loop as loop
    from mrl.config.loader import load
    from mrl.train import source

    out = out or tempfile.mkdtemp(prefix="step-path-")
    spec, _ = load(str(REPO / job), ["platform.ranks_per_node=1", "parallel.tensor=1", "trainer.total_steps=1",
                                     "checkpoint.every_steps=-1", "tracking.backends=[]", f"job.output_dir={out}",
                                     *overrides])
    trace = PathTrace()
    step_fn = loop.train_step
    classes = (source.ColocatedRollouts, source.SeparateRollouts)
    publish = {cls: cls.publish for cls in classes}
    own = {cls: "publish" in vars(cls) for cls in classes}   # defined on the class, not inherited

    def traced_step(*a, **kw):
        sys.setprofile(trace)
        return step_fn(*a, **kw)

    def traced_publish(cls):
        def wrapped(self, version):
            try:
                return publish[cls](self, version)
            finally:
                if version == 1:   # the weights step 1 made have left: the step's path ends here
                    sys.setprofile(None)
        return wrapped

    loop.train_step = traced_step
    for cls in classes:
        cls.publish = traced_publish(cls)
    try:
        loop.train(spec)
    finally:
        sys.setprofile(None)
        loop.train_step = step_fn
        for cls in classes:
            if own[cls]:
                cls.publish = publish[cls]
            else:
                del cls.publish
    return trace


def main(argv: list[str]) -> None:
    job = argv[0] if argv and argv[0].endswith(".toml") else "jobs/quickstart_cpu.toml"
    overrides = argv[1:] if argv and argv[0].endswith(".toml") else argv
    trace = step_path(job, tuple(overrides))
    for i, (site, where) in enumerate(trace.entries, 1):
        print(f"{i:3d} {site} -> {where}")
    n = trace.summary()
    print(f"places {n['places']} entries {n['entries']} (sites {n['sites']}) "
          f"re-entries {n['re-entries']} (sites {n['re-entry sites']})")


if __name__ == "__main__":
    main(sys.argv[1:])
