"""Text that fits where it is pasted: GitHub takes at most 65,536 characters in an issue or comment body.

A report is a fixed part (always shown) and sections whose items (table rows, list entries) are shown while
they fit the section's share of what is left; a section may carry a folded form (counts instead of rows) to
show instead when its items do not fit. `cap` is the last guard: whatever a renderer made is cut to the limit
at a line, with a note, and never leaves a code fence or a <details> block open.
"""

from __future__ import annotations

from dataclasses import dataclass

GITHUB_LIMIT = 65_536  # characters GitHub takes in an issue or comment body
SLACK = 1_000  # left for the joins, the redaction's replacements and the user's own words


def left_out_note(count: int) -> str:
    return (f"_… and {count} more, left out to fit GitHub's {GITHUB_LIMIT:,}-character limit: "
            "`attn-doctor report RESULTS --format html` shows them all._")


@dataclass
class Section:
    """A report section whose `items` are shown in order while they fit its share of the page; `head` and
    `tail` are always shown. When the items do not all fit, `folded` (if any) is shown instead, cut the same
    way. A table's items need `table=True`: a line after a table's rows must follow a blank line, or GitHub
    reads it as one more row."""

    head: list[str]
    items: list[str]
    tail: list[str]
    share: float
    table: bool = False
    folded: Section | None = None
    named: str = ""  # what a page that leaves the whole section out calls it ("" : its heading's words)

    def name(self) -> str:
        return self.named or self.head[0].strip("*").lower()

    def size(self, items: int | None = None) -> int:
        shown = self.items if items is None else self.items[:items]
        return sum(len(line) + 1 for line in (*self.head, *shown, *self.tail))

    def render(self, budget: int, note=left_out_note) -> list[str]:
        """The section within `budget` characters; `note(count)` says what was left out."""
        if self.size() <= budget:
            return [*self.head, *self.items, *self.tail]
        if self.folded is not None:
            return self.folded.render(budget, note)
        shown = 0
        while shown < len(self.items) and self.size(shown + 1) + 200 <= budget:
            shown += 1
        # A table's header and delimiter rows are its heading's last two lines: without a row they are no table
        head = self.head[:-2] if self.table and not shown else self.head
        return [*head, *self.items[:shown], *([""] if self.table and shown else []), note(len(self.items) - shown),
                *self.tail]


def fit_sections(fixed: int, sections: list[Section]) -> list[list[str]]:
    """Each section rendered within its share of what the fixed parts (`fixed` characters) leave of GitHub's
    limit; what a section does not need goes to the others, in proportion to their shares."""
    room = max(GITHUB_LIMIT - fixed - SLACK, 0)
    if sum(s.size() for s in sections) <= room:  # everything fits: no share needs working out
        return [s.render(s.size()) for s in sections]
    budgets = {i: room * s.share for i, s in enumerate(sections)}
    needy = {i for i, s in enumerate(sections) if s.size() > budgets[i]}
    spare = sum(budgets[i] - sections[i].size() for i in budgets if i not in needy)
    weight = sum(sections[i].share for i in needy)
    for i in needy:
        budgets[i] += spare * sections[i].share / weight
    return [s.render(int(budgets[i])) for i, s in enumerate(sections)]


FENCE = "`" * 3
CUT_NOTE = (f"_… the rest is left out to fit GitHub's {GITHUB_LIMIT:,}-character limit: "
            "`attn-doctor report RESULTS --format html` shows it all._")


def cap(text: str, limit: int = GITHUB_LIMIT, note: str = CUT_NOTE) -> str:
    """`text` if it fits `limit`, else its first lines that fit, with what they left open closed (a code
    fence, <details> blocks) and `note` of the cut."""
    if len(text) <= limit:
        return text
    kept: list[str] = []
    size, fenced, details = 0, False, 0
    room = limit - len(note) - 4
    for line in text.split("\n"):
        still_fenced, open_details = fenced, details
        if line.startswith(FENCE):
            still_fenced = not fenced
        elif not fenced:
            open_details += line.count("<details>") - line.count("</details>")
        closing = (len(FENCE) + 1 if still_fenced else 0) + len("</details>\n") * max(open_details, 0)
        if size + len(line) + 1 + closing > room:
            break
        kept.append(line)
        size += len(line) + 1
        fenced, details = still_fenced, open_details
    closing_lines = ([FENCE] if fenced else []) + ["</details>"] * max(details, 0)
    return "\n".join([*kept, *closing_lines, "", note, ""])
