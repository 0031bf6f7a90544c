"""Checkpoint conversion tools: reassemble Megatron-layout checkpoints and export them to Hugging Face."""
