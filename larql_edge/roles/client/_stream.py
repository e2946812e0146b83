from __future__ import annotations


class TextStream:
    """Turns a growing list of token ids into printable text increments.

    Byte-fallback tokenizers can split one character over several tokens; the text is re-decoded
    as a whole and only the stable prefix is released, holding back a trailing replacement char.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent :], len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        new, self.sent = text[self.sent :], len(text)
        return new
