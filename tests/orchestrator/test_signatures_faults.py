"""The catalogue names the causes a killed rank cannot print: SIGKILL as our launcher and torch's agent report
it, an OOM kill the container's memory cgroup counted, a full disk the launcher found."""

from __future__ import annotations

import pytest

from orchestrator.sigmatch import Matcher
from orchestrator.signatures import load_catalogue


def named(lines: list[str]) -> list[str]:
    m = Matcher(load_catalogue())
    return [e.signature for line in lines for e in m.feed_line(line)]


@pytest.mark.parametrize("line", [
    "[launch] run failed: rank 2 (drafter, node 0, local rank 2, pid 4188) was killed by SIGKILL",
    "torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 1 (pid: 77) of binary",
])
def test_a_sigkilled_rank_is_a_possible_oom_kill(line):
    assert named([line]) == ["host-oom-kill"]


def test_an_oom_kill_counted_by_the_cgroup_is_named_with_its_limit_and_fix():
    line = ("[launch] killed by the container's OOM killer: 1 process(es) of this run at its memory limit 512 MiB "
            "(memory.events oom_kill 2 -> 3); raise the limit on the Proxmox host: pct set 200 --memory 1024")
    m = Matcher(load_catalogue())
    [event] = m.feed_line(line)
    assert event.signature == "container-oom-kill"
    text = m.catalogue.get(event.signature).render(event.groups)
    assert text["title"] == "Killed by the container's OOM killer (memory limit 512 MiB)"
    assert text["fix"].startswith("on the Proxmox host: pct set 200 --memory 1024; ")
    assert "(memory.events oom_kill 2 -> 3)" in text["diagnosis"]
