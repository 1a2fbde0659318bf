"""String stop sequences (rollout.sampling.stop), matched on the decoded response as it grows.

Both engines use this one matcher, so a response ends at the same token whichever engine made it: the
first token after which the response's text contains a stop string (the token that completed it is
kept; finish_reason "stop"). The string may end inside that token ("\\n\\nThe" completes "\\n\\n").

SGLang cannot match stop strings itself here: its servers run with --skip-tokenizer-init (token ids in
and out), and SGLang 0.5.17 then refuses every request with `stop` (sampling_params.py,
raise_if_tokenizer_required). So SGLangEngine matches them on the streamed tokens and ends the request.

Each check decodes only the response's last `window` tokens: one new token can only complete an
occurrence that ends in it, and an occurrence of n characters spans at most n tokens, or up to 4n when
byte-level tokens split a character's UTF-8 bytes (decoded alone they give U+FFFD, which no stop string
is expected to contain). Special tokens are decoded with their text, so "<|im_end|>" matches too
(stop_token_ids is the cheaper way to stop on one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopStrings:
    """`match(ids)`: the stop string the response `ids` now contains, or None. Called after every token,
    so an occurrence found is one the last token completed."""

    def __init__(self, stops: Sequence[str], tokenizer: Any):
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.tok = tokenizer
        self.window = 4 * max(map(len, self.stops)) + 4

    def match(self, ids: Sequence[int]) -> str | None:
        text = self.tok.decode(list(ids[-self.window :]), skip_special_tokens=False)
        return next((s for s in self.stops if s in text), None)

    def first_match(self, ids: Sequence[int], start: int = 0) -> tuple[int, str] | None:
        """(n, the string) for the shortest prefix ids[:n] (n > start) that match() finds one in; None if
        there is none. For tokens that arrive several at a time (SGLang's streamed chunks)."""
        for n in range(start + 1, len(ids) + 1):
            found = self.match(ids[:n])
            if found is not None:
                return n, found
        return None
