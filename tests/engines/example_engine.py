"""The example engine of docs/engines.md ("Adding an engine"): torch DDP, every rank holding the whole model."""

from orch.plans.engine_settings import EngineSettings, ZeroStage
from orch.plans.engines import DeviceMemory, EngineSpec
from orch.plans.engines.base import schema_default
from orch.plans.errors import Violation
from orch.plans.memory.states import model_state_bytes, step_phases
from orch.plans.spec import FSDPSpec, Offload


class DDPSpec(EngineSpec):
    name, runtime = "ddp_example", "example_ddp_runtime:DDPEngine"
    summary, buffers_label = "torch DDP: every rank holds the whole model and its optimizer", "DDP buckets"

    def violations(self, plan, cluster):
        return super().violations(plan, cluster) + [
            Violation(f"plan.{key}", getattr(plan, key), "torch DDP neither shards, pipelines nor offloads.",
                      f"leave plan.{key} at its default, or set plan.engine=deepspeed")
            for key in ("zero_stage", "pp", "offload_optimizer", "offload_param")
            if getattr(plan, key) != schema_default(key)]

    def settings(self, plan, optim, param_count=None):
        return EngineSettings(zero_stage=ZeroStage.none, torch_adam=True)

    def device_memory(self, plan, cluster, optim, probe, engine, activations):
        stats = probe.stats_for(plan.tp)
        states = model_state_bytes(param_count=stats.param_count, trainable_count=stats.trainable_count, zero_stage=0,
                                   dp=plan.dp, precision=plan.precision, optimizer=optim.name, momentum=optim.momentum,
                                   offload_optimizer=Offload.none, offload_param=Offload.none)
        return DeviceMemory(per_stage=[(states, step_phases(engine, states=states, model=stats, activations=activations,
                                                            dp=plan.dp, precision=plan.precision,
                                                            grad_accum_steps=plan.grad_accum_steps))])

    def search_settings(self, space, pp):
        return [(0, FSDPSpec())] if pp == 1 else []


SPEC = DDPSpec()
