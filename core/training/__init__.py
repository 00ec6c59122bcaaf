"""Draft-head training: self-distilled answers -> base-model features -> a trained head."""
