"""A Hugging Face Llama model on cupy-rope, in one line: ``cupy_rope.hf.patch(model)``.

Builds a small randomly initialised LlamaForCausalLM from a config (nothing
is downloaded), patches it, and checks logits, a training step's gradients
and greedy generation against the stock model. Needs a CUDA GPU and
``transformers``.
"""

import copy
import sys

import torch
import transformers

if not torch.cuda.is_available():
    print("no CUDA device: nothing to run")
    sys.exit(0)

import cupy_rope.hf

config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, max_position_embeddings=1024)
torch.manual_seed(0)
stock = transformers.LlamaForCausalLM(config).cuda()
model = cupy_rope.hf.patch(copy.deepcopy(stock))   # <- the one line

ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
for m in (stock, model):
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
diff = (model(input_ids=ids).logits - stock(input_ids=ids).logits).abs().max().item()
gdiff = max((p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), stock.parameters()))
print(f"logits max |diff| {diff:.3g}, parameter gradients max |diff| {gdiff:.3g}")

with torch.no_grad():
    prompt = ids[:1, :8]
    a = stock.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    b = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
print("greedy generation identical:", torch.equal(a, b))
