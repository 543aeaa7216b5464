"""Step 2: pads each prompt of raw.json to exactly 4096 tokens (the gold answer and a short closing turn) so that
`sparsekv dump --seq-len 4096` puts one prompt per sequence; writes niah.txt and niah-meta.json. Step 3: needle.py."""
import json
from sparsekv.models import load_model
tok = load_model("smollm2-135m", quiet=True).tokenizer
raw = json.load(open("raw.json"))
texts, meta = [], []
for info, text in zip(raw["samples"], raw["texts"]):
    ids = tok.encode(text, add_special_tokens=False)
    tail = tok.encode(" " + ", ".join(info["answer"]) + ".<|im_end|>\n<|im_start|>user\nThank you, that is correct.<|im_end|>\n", add_special_tokens=False)
    pad = tail[: 4096 - len(ids)]
    assert len(ids) + len(pad) == 4096, (info["subtask"], len(ids), len(tail))
    full = ids + pad
    t = tok.decode(full, skip_special_tokens=False)
    assert tok.encode(t, add_special_tokens=False) == full, info["subtask"]
    texts.append(t); meta.append(dict(info, prompt_tokens=len(ids), appended=tok.decode(pad)))
all_text = "".join(texts)
all_ids = tok.encode(all_text, add_special_tokens=False)
print(len(all_ids), all(all_ids[i*4096:(i+1)*4096] == tok.encode(t, add_special_tokens=False) for i, t in enumerate(texts)))
open("niah.txt", "w").write(all_text)
json.dump(meta, open("niah-meta.json", "w"), indent=1)
for m in meta: print(m["subtask"], m["prompt_tokens"], repr(m["appended"]))
