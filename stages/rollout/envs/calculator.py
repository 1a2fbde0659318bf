"""A calculator tool for reasoning-gym arithmetic: the built-in multi-turn environment.

An episode (one sample): the model may call the tool as `<tool>EXPRESSION</tool>` and end its turn;
the environment evaluates the expression and appends the result as a `tool` chat message (the chat
template's tokens, loss_mask 0); the model then answers, `<answer>RESULT</answer>`, and is scored by
the task's reward (reasoning_gym). With the tiny model's template a solved episode is

    prompt    <|im_start|>Calculate 34 + 12.\\nGive your final answer inside <answer></answer> tags.<|im_end|><|im_start|>
    model     <tool>34 + 12</tool><|im_end|>
    tool      <|im_start|>tool\\n46<|im_end|><|im_start|>
    model     <answer>46</answer><|im_end|>

Use: rollout.generate_fn=stages.rollout.envs.calculator:generate with reward.fn=reasoning_gym
(configs/tool-calc-cpu.yaml; model tiny-qwen2-calc).
generate_kwargs: max_tool_calls (default 2), tool_timeout_s (default 5), max_turn_tokens (default:
the whole budget, rollout.sampling.max_new_tokens).
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from fractions import Fraction

from buffer.record import Sample
from stages.rollout.hooks import GenerateContext, gather_or_cancel
from stages.rollout.multiturn import Conversation, TurnTemplate

TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 200
MAX_EXACT = 10**100  # integers below this are written out; larger values as floats (e.g. 1.5e+120)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses, unary minus), exact
    (fractions), as text. A malformed expression, a division by zero or a number out of range is the
    model's mistake, not the tool's: it gets an "error: ..." result to read, as a real tool would
    answer, rather than failing the sample."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
        if value.denominator == 1 and abs(value.numerator) < MAX_EXACT:
            return str(value.numerator)
        return f"{float(value):.6g}"
    except ZeroDivisionError:
        return "error: division by zero"
    except ArithmeticError:  # OverflowError: 1e999 (infinite), or a result past the float range
        return "error: number out of range"
    except (SyntaxError, ValueError, TypeError):
        return "error: syntax"


def _eval(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError(f"unsupported syntax {type(node).__name__}")


@functools.lru_cache(maxsize=8)
def _template(tokenizer) -> TurnTemplate:
    return TurnTemplate(tokenizer)


async def episode(ctx: GenerateContext, sample: Sample, tool=calculate) -> Sample:
    """One sample's episode: model turns and tool results until the model answers without a tool call,
    the budget is spent, or the tool fails."""
    k = ctx.kwargs
    conv = Conversation(
        ctx.prompt.ids,
        ctx.engine,
        ctx.params,
        template=_template(ctx.tokenizer),
        max_turn_tokens=k.get("max_turn_tokens"),
    )
    max_calls, calls = int(k.get("max_tool_calls", 2)), 0
    while True:
        res = await conv.generate()
        if conv.done:
            break
        call = TOOL_CALL.search(conv.turn_text(res))
        if call is None or calls >= max_calls:  # an answer (or one call too many): the episode ends
            break
        calls += 1
        result = await conv.call_tool(tool, call.group(1), timeout_s=float(k.get("tool_timeout_s", 5.0)))
        if conv.done:  # the tool failed
            break
        conv.append_messages([{"role": "tool", "content": str(result)}])
    conv.finish()
    conv.metadata["tool_calls"] = calls
    return conv.fill(sample)


async def generate(ctx: GenerateContext) -> list[Sample]:
    """generate_fn: the episodes of a group (or of one sample) run at once; the engine batches them.
    An engine error in one episode cancels the others (the group is retried whole)."""
    return list(await gather_or_cancel(*(episode(ctx, s) for s in ctx.samples)))
