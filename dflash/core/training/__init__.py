"""What training a drafter needs before any framework loads: the run's settings (TrainConfig), the prompt / chat
datasets and their tokenisation, and the regenerated-answers file. Used by backends/torch/training, the data and train
CLIs, the benchmark's prompts and the reference build; the speculative loop never imports it."""
