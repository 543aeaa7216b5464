"""The offline stages' shared machinery: a dump's training examples (`data`), one batched training loop with
checkpoints, resume and progress (`train`), and the artifact a stage writes (`stage`). `train-hash` (Spotlight),
`index` (SAAP) and `calibrate` (Adamas) use these pieces instead of keeping copies."""
