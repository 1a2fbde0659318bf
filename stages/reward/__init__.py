"""Reward functions: built-in verifiers by name and custom ones by `module:function` path.

See stages/reward/registry.py for the calling convention and stages/reward/builtin.py for the
built-ins (exact_match, math, reasoning_gym, digit_repeat).
"""
