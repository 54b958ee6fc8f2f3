"""Checks for each lesson's exercises.

The same check runs on the engine's code in CI (tests/) and on the learner's code in the lesson
notebook. Each compares against an independent oracle (Hugging Face transformers or plain torch)
and raises AssertionError with a hint when the numbers differ.
"""
