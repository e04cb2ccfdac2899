"""The end-to-end benchmark's peers (benchmarks/e2e_throughput.py): HF transformers `generate`
backbone-only on one batch, and HF + PEFT with `adapter_names` on a mixed batch of 8 adapters,
same model shape (random init) and prompt length."""

import time

import torch


def hf_peers(cfg, batch, prompt, new, peft_new, modules):
    """[(system, workload, tok/s)]: HF backbone generating `new` tokens, HF + PEFT (rank 16 on
    `modules`, adapters p0..p7 in turn over the batch) generating `peft_new`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=4096,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(hc).to(torch.float16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    rows = []

    def gen(m, n_new, **kw):
        m.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False, **kw)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = m.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, **kw)
        torch.cuda.synchronize()
        return (out.shape[1] - prompt) * batch / (time.perf_counter() - start)

    with torch.no_grad():
        rows.append(("hf", "backbone", gen(model, new)))
        lcfg = LoraConfig(
            r=16, lora_alpha=32, target_modules=list(modules), init_lora_weights=False, task_type="CAUSAL_LM"
        )
        peft = get_peft_model(model, lcfg, adapter_name="p0")
        for k in range(1, 8):
            peft.add_adapter(f"p{k}", lcfg)
        peft = peft.to(torch.float16).eval()
        names = [f"p{i % 8}" for i in range(batch)]
        rows.append(("hf_peft", "uniform8", gen(peft, peft_new, adapter_names=names)))
    del model, peft
    torch.cuda.empty_cache()
    return rows
