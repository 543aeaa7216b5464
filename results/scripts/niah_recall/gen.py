"""Step 1 of the NIAH selection measurement: one RULER NIAH prompt per subtask (4096 + 128 tokens, seed 42, the
jargon haystack) from the project's own generator, checked to round-trip through the tokenizer; writes raw.json."""
import json
from sparsekv.models import load_model
from sparsekv.eval.ruler.generate import make_samples
lm = load_model("smollm2-135m", quiet=True)
tok = lm.tokenizer
samples, skipped = make_samples(tok, seq_len=4096 + 128, n=1, seed=42, subtasks="niah",
                                haystack_file="/usr/share/doc/jargon-text/jargon.txt.gz")
info = []
for s in samples:
    text = tok.decode(s.ids, skip_special_tokens=False)
    re_ids = tok.encode(text, add_special_tokens=False)
    print(s.subtask, len(s.ids), re_ids == list(s.ids), s.answer, s.depth, repr(text[:60]), repr(text[-120:]))
    info.append(dict(subtask=s.subtask, n=len(s.ids), roundtrip=re_ids == list(s.ids), answer=s.answer, depth=s.depth))
json.dump({"samples": info, "texts": [tok.decode(s.ids, skip_special_tokens=False) for s in samples]}, open("raw.json", "w"))
