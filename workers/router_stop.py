"""Stop sequences over a stream of generated text.

A stop string may arrive split over several tokens, so text that could be the start
of one is held back until it is known not to be; what is released never contains a
stop string nor any text after one (OpenAI's semantics: the stop string itself is
not returned).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Releases text up to the first stop string of ``stops``.

    ``feed(text)`` returns ``(released, stopped)``: ``released`` is safe to show the
    client; once ``stopped`` is true the generation is over and later calls are an
    error. ``flush()`` releases what was held back (the generation ended without a
    stop string). Holding back at most ``max(len(stop)) - 1`` characters.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stops: a stop string must not be empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("feed: the text already reached a stop string")
        if not self._stops:
            return text, False
        pending = self._pending + text
        ends = [at + len(stop) for stop in self._stops if (at := pending.find(stop)) >= 0]
        if ends:
            # Generation stops where the first stop string completes; the text is cut
            # at the leftmost one complete by then. Both are independent of how the
            # text was split into tokens.
            seen = pending[: min(ends)]
            cut = min(at for stop in self._stops if (at := seen.find(stop)) >= 0)
            self._pending = ""
            self.stopped = True
            return pending[:cut], True
        # The longest tail that is a proper prefix of some stop string: any match that
        # starts earlier would have to extend a longer such tail, so none can.
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(pending) - hold
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
