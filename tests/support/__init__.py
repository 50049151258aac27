"""What the tests share: the spawn harness, models, faults, references and the CUDA stream model."""
