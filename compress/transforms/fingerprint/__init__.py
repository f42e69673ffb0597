"""Chain & Hash model fingerprints (Russinovich & Salem, arXiv 2407.10887).

``key``: key generation, the chained SHA-256 answer selection and the key file;
``prompts``: padding, meta-prompts and chat templates; ``insert``: fine-tuning the fingerprint in
(LoRA via peft or full, through accelerate); ``verify``: black-box verification of a checkpoint or
an OpenAI-compatible endpoint with a binomial p-value.
"""

from compress.transforms.fingerprint.key import (FingerprintKey, FingerprintQuestion, KeygenConfig, canonical_item,
                                                 chain_digests, chain_message, generate_key, load_key, save_key,
                                                 select_indices)
from compress.transforms.fingerprint.verify import (EndpointChat, EndpointError, LocalChat, VerifyConfig, VerifyResult,
                                                    binomial_sf, contains_answer, verify_fingerprint, verify_with)

__all__ = [
    "FingerprintKey", "FingerprintQuestion", "KeygenConfig", "canonical_item", "chain_digests", "chain_message",
    "generate_key", "load_key", "save_key", "select_indices", "EndpointChat", "EndpointError", "LocalChat",
    "VerifyConfig", "VerifyResult", "binomial_sf", "contains_answer", "verify_fingerprint", "verify_with",
    "InsertConfig", "InsertResult", "insert_fingerprint",
]


def __getattr__(name):  # the training module (torch, peft, accelerate) loads only when asked for
    if name in ("InsertConfig", "InsertResult", "insert_fingerprint"):
        from compress.transforms.fingerprint import insert

        return getattr(insert, name)
    raise AttributeError(name)
