"""Sparse autoencoders: TopK math, the Qwen-Scope release registry, loading, sae-lens interop, training."""
from saes.bank import SAEBank
from saes.fused import fused_encode, fused_encode_async
from saes.interop import from_sae_lens, to_sae_lens
from saes.loading import SAEFileError, check_d_model, load, read_release_file
from saes.registry import Release, get_release, list_releases, parse_repo_id
from saes.topk import SAEConfig, SparseCodes, TopKSAE
from saes.training import SAETrainer, SAETrainingConfig, TrainingResult, evaluate_sae, save_release, save_sae, train_sae

__all__ = [
    "Release", "SAEBank", "SAEConfig", "SAEFileError", "SparseCodes", "TopKSAE", "check_d_model", "from_sae_lens", "fused_encode",
    "fused_encode_async", "get_release", "list_releases", "load", "parse_repo_id", "read_release_file", "to_sae_lens",
    "SAETrainer", "SAETrainingConfig", "TrainingResult", "evaluate_sae", "save_release", "save_sae", "train_sae",
]
