"""Reference embedding of a 200-token input for all-MiniLM-L6-v2, as sentence-transformers
computes it: tokenised with truncation at the model's `max_seq_length` (sentence_bert_config.json,
256), BERT forward, mean pooling under the mask, L2 normalisation. Writes the fixture used by
crates/wick-zoo/tests/minilm.rs.

    python scripts/torch-reference/minilm_long.py MODEL_DIR crates/wick-zoo/tests/fixtures/minilm-long.json
"""
import json
import sys

import torch
from transformers import AutoTokenizer, BertModel

model_dir, out = sys.argv[1], sys.argv[2]
max_len = json.load(open(f"{model_dir}/sentence_bert_config.json"))["max_seq_length"]
text = " ".join(f"word{i % 37} is number {i}." for i in range(40))
tok = AutoTokenizer.from_pretrained(model_dir)
enc = tok([text], truncation=True, max_length=max_len, padding=False, return_tensors="pt")
n_tokens = enc["input_ids"].shape[1]
assert 128 < n_tokens <= max_len, n_tokens
model = BertModel.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
with torch.no_grad():
    hidden = model(**{k: v for k, v in enc.items()}).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    emb = torch.nn.functional.normalize(pooled, dim=-1)[0]
json.dump({"text": text, "tokens": n_tokens, "max_seq_length": max_len, "embedding": emb.tolist()}, open(out, "w"))
print(n_tokens, emb[:4].tolist())
