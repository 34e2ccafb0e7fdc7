"""Small llama-like model files the tests write themselves (safetensors and GGUF)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def llama_tensors(n_layers: int = 4, hidden: int = 64, ffn: int = 160, vocab: int = 512,
                  seed: int = 0, hf_names: bool = True) -> dict[str, np.ndarray]:
    """Random float16/float32 weights with Hugging Face llama names, in checkpoint order."""
    rng = np.random.default_rng(seed)

    def t(*shape: int, dt: type = np.float16) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    p = "model." if hf_names else ""
    out = {f"{p}embed_tokens.weight": t(vocab, hidden)}
    for i in range(n_layers):
        for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)),
                            ("self_attn.k_proj.weight", (hidden, hidden)),
                            ("self_attn.v_proj.weight", (hidden, hidden)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (ffn, hidden)),
                            ("mlp.up_proj.weight", (ffn, hidden)),
                            ("mlp.down_proj.weight", (hidden, ffn))):
            out[f"{p}layers.{i}.{name}"] = t(*shape)
        out[f"{p}layers.{i}.input_layernorm.weight"] = t(hidden, dt=np.float32)
        out[f"{p}layers.{i}.post_attention_layernorm.weight"] = t(hidden, dt=np.float32)
    out[f"{p}norm.weight"] = t(hidden, dt=np.float32)
    out["lm_head.weight"] = t(vocab, hidden)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "np"})
    return path


def gguf_tensors(n_layers: int = 4, hidden: int = 64, ffn: int = 160, vocab: int = 512,
                 seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def t(*shape: int, dt: type = np.float16) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    out = {"token_embd.weight": t(vocab, hidden), "rope_freqs.weight": t(8, dt=np.float32)}
    for i in range(n_layers):
        out[f"blk.{i}.attn_norm.weight"] = t(hidden, dt=np.float32)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out[f"blk.{i}.{name}.weight"] = t(hidden, hidden)
        out[f"blk.{i}.ffn_norm.weight"] = t(hidden, dt=np.float32)
        out[f"blk.{i}.ffn_gate.weight"] = t(ffn, hidden)
        out[f"blk.{i}.ffn_up.weight"] = t(ffn, hidden)
        out[f"blk.{i}.ffn_down.weight"] = t(hidden, ffn)
    out["output_norm.weight"] = t(hidden, dt=np.float32)
    out["output.weight"] = t(vocab, hidden)
    return out


def write_gguf(path: Path, tensors: dict[str, np.ndarray], quantized: bool = True) -> Path:
    """A GGUF file; with ``quantized`` one extra Q8_0 tensor (raw bytes) per file."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(sum(1 for n in tensors if n.endswith(".attn_q.weight")))
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    if quantized:
        q = np.random.default_rng(2).integers(0, 255, (4, 34), dtype=np.uint8)
        w.add_tensor("blk.0.extra_q8.weight", q, raw_shape=(4, 34),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> Path:
    """A safetensors file written by hand, for dtypes NumPy lacks (BF16, F8_E4M3)."""
    import json
    import struct

    header: dict[str, object] = {}
    body = b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return path


QUANT_KVS = {"general.name": "quant-test", "test.context_length": 4096,
             "test.rope_scale": 0.5, "test.causal": True,
             "tokenizer.ggml.tokens": ["<s>", "</s>", "hello", "wörld"]}


def write_quantized_gguf(path: Path, seed: int = 3) -> Path:
    """A GGUF with a Q8_0 matrix of logical shape (512, 256), a Q4_0 one of
    (64, 256), an F16 and an F32 tensor (llama-style names: prolog, layer 0,
    epilog), and ``QUANT_KVS`` (a string, an int, a float, a bool and an
    array of strings) beside ``general.architecture``."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("general.name", QUANT_KVS["general.name"])
    w.add_uint32("test.context_length", QUANT_KVS["test.context_length"])
    w.add_float32("test.rope_scale", QUANT_KVS["test.rope_scale"])
    w.add_bool("test.causal", QUANT_KVS["test.causal"])
    w.add_array("tokenizer.ggml.tokens", QUANT_KVS["tokenizer.ggml.tokens"])
    big = rng.standard_normal((512, 256), dtype=np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(big, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(big[:64], Q.Q4_0),
                 raw_dtype=Q.Q4_0)
    w.add_tensor("blk.0.attn_norm.weight", big[0].astype(np.float16))
    w.add_tensor("output_norm.weight", big[1, :32].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def corrupt_tensor(path: Path, tensor: str) -> None:
    """Flip one byte of ``tensor``'s data in the model file at ``path`` (its
    sixth: a flip always changes it, whatever the byte was)."""
    from rpcbuf.models.modelfile import open_model

    model = open_model(path)
    _, at = model.where(tensor)
    model.close()
    with open(path, "r+b") as f:
        f.seek(at + 5)
        byte = f.read(1)
        f.seek(at + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def cached_model(tmp_path: Path, monkeypatch: object) -> tuple[dict[str, np.ndarray], Path]:
    """A 3-layer model file in ``tmp_path`` and a client hash cache of the
    test's own (``RPCBUF_CACHE_DIR``): what the re-load tests start from."""
    monkeypatch.setenv("RPCBUF_CACHE_DIR", str(tmp_path / "hashes"))  # type: ignore[attr-defined]
    tensors = llama_tensors(3)
    return tensors, write_safetensors(tmp_path / "m.safetensors", tensors)
