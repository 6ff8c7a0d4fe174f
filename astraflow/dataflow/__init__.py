"""Data algorithms as stream processors."""

from astraflow.dataflow.admission import Admission
from astraflow.dataflow.autoscaler import Autoscaler
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.dataflow.batcher import Batcher
from astraflow.dataflow.class_balance import ClassBalance
from astraflow.dataflow.curriculum import Curriculum
from astraflow.dataflow.downsample import Downsample
from astraflow.dataflow.dynamic_sampling import DynamicSampling
from astraflow.dataflow.greso import Greso
from astraflow.dataflow.mixer import Mixer
from astraflow.dataflow.passthrough import Passthrough
from astraflow.dataflow.reward_norm import RewardNorm
from astraflow.dataflow.router import PolicyRouter
from astraflow.dataflow.rules import RuleRouter
from astraflow.dataflow.staleness import StalenessFilter
from astraflow.wire.validate import InvalidRecord

PROCESSOR_KINDS: dict[str, type[Processor]] = {
    cls.kind: cls for cls in (Passthrough, StalenessFilter, PolicyRouter, Batcher)
}
# data algorithms: prompt selection, curriculum, mixing, post-rollout filters and
# down-sampling, rule routing
PROCESSOR_KINDS.update({
    cls.kind: cls
    for cls in (Greso, Curriculum, Mixer, DynamicSampling, RewardNorm, RuleRouter,
                ClassBalance, Downsample)
})

# backpressure: holds tasks back while the RaaS pool or a trainer lags
PROCESSOR_KINDS[Admission.kind] = Admission
# advice on RaaS pool sizes from the trainers' waiting (ScalingAdvice on `scaling`)
PROCESSOR_KINDS[Autoscaler.kind] = Autoscaler

__all__ = ["Incoming", "InvalidRecord", "Outgoing", "Processor", "PROCESSOR_KINDS"]
