"""Pure logic of the tokenize stage: conversations in, token ids and loss masks out.

- `conversation`: reading one completion record into a checked conversation (or a reject reason).
- `render`: rendering it with the model's own chat template, piece by piece, and deciding which
  characters are supervised (assistant turns after their generation prompt, through their end of turn).
- `encode`: turning the rendered pieces into token ids and a loss mask that agree token for token.
- `policy`: truncation, the "two consecutive supervised tokens" rule, the mask-token check.
- `stats`: counters, the length histogram and its picture.

Nothing here reads or writes files; the job (`regen.jobs.tokenize`) does the I/O.
"""
