"""Stop checks on committed tokens, including characters split over several tokens."""

from exactspec.stopping import StopChecker

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
    assert checker.stop_reason == "🍕"


def test_stop_string_before_min_new_tokens_is_not_found_later():
    ids = list(b"ab.cd.ef")
    checker = StopChecker(ByteTokenizer(), (), ["."], min_new_tokens=4)
    assert feed(checker, ids) == 6  # the first "." (token 3) was suppressed, not remembered


def test_stop_token_ids_and_earliest_stop_string():
    assert feed(StopChecker(ByteTokenizer(), [ord("c")], []), list(b"abcd")) == 3
    checker = StopChecker(ByteTokenizer(), (), ["xyz", "yz", "q"])
    assert feed(checker, list(b"wxyzq")) == 4 and checker.stop_reason == "xyz"
