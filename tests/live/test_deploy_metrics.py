"""Every Triton metric the Kubernetes autoscaler rules and the Grafana dashboard use is one this
Triton release exports (GPU metrics excepted: no GPU here)."""

from __future__ import annotations

import re

from tests.live.support import metrics_text
from tests.unit.test_deploy import GPU_ONLY, referenced_metrics


def test_every_triton_metric_the_deployment_uses_is_exported(server):
    exported = set(re.findall(r"^(nv_[a-z_]+)", metrics_text(server), flags=re.MULTILINE))
    used = {m for m in referenced_metrics() if m.startswith("nv_")}
    assert used, "the deployment uses no Triton metric?"
    assert used - GPU_ONLY <= exported, sorted(used - GPU_ONLY - exported)
