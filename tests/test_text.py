"""Stop checks on committed tokens, including characters split over several tokens; where
the stop string matched; each token's share of the text."""

from exactspec.text import StopChecker, find_stop, token_pieces

PIZZA = "🍕".encode()  # 4 bytes


class ByteTokenizer:
    """Token i < 256 is byte i, as in byte-level BPE: a character may span tokens."""

    def decode(self, token_ids):
        return bytes(token_ids).decode("utf-8", errors="replace")


def feed(checker, ids):
    for n in range(1, len(ids) + 1):
        if checker.is_stop(ids[:n]):
            return n
    return None


def test_stop_string_made_of_a_split_character():
    ids = list(b"ok ") + list(PIZZA) + list(b" more")
    checker = StopChecker(ByteTokenizer(), (), ["🍕"])
    assert feed(checker, ids) == 3 + len(PIZZA)  # stops at the byte that completes it
    assert checker.stop_reason == "🍕" and checker.stop_offset == 3


def test_stop_string_before_min_new_tokens_is_not_found_later():
    ids = list(b"ab.cd.ef")
    checker = StopChecker(ByteTokenizer(), (), ["."], min_new_tokens=4)
    assert feed(checker, ids) == 6  # the first "." (token 3) was suppressed, not remembered


def test_stop_token_ids_and_earliest_stop_string():
    assert feed(StopChecker(ByteTokenizer(), [ord("c")], []), list(b"abcd")) == 3
    checker = StopChecker(ByteTokenizer(), (), ["xyz", "yz", "q"])
    assert feed(checker, list(b"wxyzq")) == 4 and checker.stop_reason == "xyz"
    assert checker.stop_offset == 1


def test_find_stop_looks_only_past_what_was_searched():
    assert find_stop("abcabc", ["bc", "c"]) == (1, "bc")
    assert find_stop("abcabc", ["bc", "c"], searched=3) == (4, "bc")
    assert find_stop("abcabc", ["ca"], searched=3) == (2, "ca")  # ends past the searched 3
    assert find_stop("abcabc", ["ab"], searched=6) is None


def test_token_pieces_join_to_the_text():
    table = {0: b"\xc3", 1: b"\xa9", 2: b"x", 3: b""}  # "é" in two tokens, "x", no text
    decode = lambda ids: b"".join(table[t] for t in ids).decode("utf-8", "replace")
    assert token_pieces([2, 0, 1, 3, 2], decode) == ["x", "", "é", "", "x"]
