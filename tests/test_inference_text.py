"""TextStream: the text sent as tokens arrive, never a stop string nor half a character."""

from jax_ai_stack.recipes.inference.text import TextStream


def utf8(ids):
  return bytes(ids).decode("utf-8", errors="replace")


def feed(stream, text: str, *, step: int = 1) -> list[str]:
  data = list(text.encode("utf-8"))
  pieces = [stream.add(data[i:i + step]) for i in range(0, len(data), step)]
  return pieces + [stream.add([], final=True)]


def test_the_pieces_join_to_the_whole_text_and_no_piece_holds_half_a_character():
  stream = TextStream(utf8)
  pieces = feed(stream, "naïve → ok")
  assert "".join(pieces) == stream.text == "naïve → ok"
  assert all("\ufffd" not in piece for piece in pieces)


def test_a_stop_string_split_over_tokens_ends_the_text_before_it():
  stream = TextStream(utf8, stops=["END", "\n\n"])
  pieces = feed(stream, "one\ntwo\n\nthree")
  assert stream.stopped and stream.text == "one\ntwo" and "".join(pieces) == "one\ntwo"
  assert stream.add([65]) == ""  # Nothing after a stop.


def test_a_partial_stop_string_that_does_not_complete_is_sent_in_the_end():
  stream = TextStream(utf8, stops=["ENDING"])
  assert "".join(feed(stream, "THE END", step=2)) == "THE END" and not stream.stopped


def test_the_earliest_stop_string_wins():
  stream = TextStream(utf8, stops=["b", "ab"])
  feed(stream, "xxabc", step=5)
  assert stream.text == "xx"


def test_an_unfinished_character_at_the_end_is_sent_as_decoded():
  stream = TextStream(utf8)
  assert stream.add(list("é".encode())[:1]) == ""
  assert stream.add([], final=True) == "\ufffd"


def test_a_last_token_that_ended_the_completion_is_not_text():
  eos = 257
  stream = TextStream(lambda ids: bytes(t for t in ids if t < 256).decode() + "|" * (eos in ids),
                      end_ids=[eos])
  assert stream.add([104, 105]) == "hi"
  assert stream.add([eos], final=True) == "" and stream.text == "hi"


def reference(adds: list[list[int]], stops: list[str]) -> str:
  """The text of the tokens added, cut at the first stop string to appear after an add
  (the earliest of those that did): the whole completion decoded and searched each time."""
  tokens = []
  for data in adds:
    tokens += data
    full = utf8(tokens)
    cuts = [at for at in (full.find(stop) for stop in stops) if at >= 0]
    if cuts:
      return full[:min(cuts)]
  return utf8(tokens)


def test_pieces_of_random_text_and_steps_join_to_the_whole_text_cut_at_its_stops():
  """Multi-byte characters split over tokens, an invalid byte now and then, stops that
  overlap each other and the text: what is sent is what decoding it all at once gives."""
  import random

  rng = random.Random(0)
  alphabet = "ab ab\né→😀"
  for trial in range(1000):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
    data = list(text.encode("utf-8"))
    for _ in range(rng.randrange(0, 3)):
      data.insert(rng.randrange(0, len(data) + 1), 0xFF)
    stops = [text[i:i + rng.randrange(1, 6)] for i in
             (rng.randrange(0, max(len(text), 1)) for _ in range(rng.randrange(0, 4)))]
    stops = [stop for stop in stops if stop] + (["ba"] if trial % 2 else [])
    stream = TextStream(utf8, stops=stops)
    step = rng.randrange(1, 5)
    adds = [data[i:i + step] for i in range(0, len(data), step)]
    pieces = [stream.add(tokens) for tokens in adds] + [stream.add([], final=True)]
    assert "".join(pieces) == stream.text == reference(adds, stops), (text, data, stops)


def test_each_step_decodes_and_matches_only_its_new_tokens():
  """A long completion against a long stop string: the tokens decoded per step stay a
  handful (not the whole completion), and 50,000 characters of stop cost no more per step
  than a short one (once quadratic: minutes)."""
  import time

  decoded = []

  def counting(ids):
    decoded.append(len(ids))
    return utf8(ids)

  stream = TextStream(counting, stops=["é" * 50_000, "xyz"])
  data = list(("é" * 600 + "abc" * 300).encode("utf-8"))
  started = time.perf_counter()
  pieces = [stream.add([byte]) for byte in data]
  elapsed = time.perf_counter() - started
  assert "".join(pieces + [stream.add([], final=True)]) == utf8(data)
  assert max(decoded) <= 4 and elapsed < 2, (max(decoded), elapsed)


def test_a_stop_found_after_a_long_held_back_prefix_cuts_before_it():
  stream = TextStream(utf8, stops=["ab" * 1000 + "c"])
  sent = "".join(stream.add(list(b"x" + b"ab" * k)) for k in (1,)) + "".join(
      stream.add(list(b"ab")) for _ in range(999))
  assert sent == "x" and not stream.stopped
  assert stream.add(list(b"cd")) == "" and stream.stopped and stream.text == "x"


def test_invalid_bytes_are_sent_as_they_come_and_an_unfinished_character_waits():
  stream = TextStream(utf8)
  pieces = [stream.add([byte]) for byte in [0xFF] * 4 + list("😀".encode())]
  assert pieces == ["", "\ufffd", "\ufffd", "\ufffd", "\ufffd", "", "", "😀"]


def test_a_token_that_decodes_to_nothing_keeps_the_space_before_the_next_word():
  """A word tokenizer joins words with spaces and leaves padding (id 0) out: the window's
  context must not shrink to the padding alone, or the next word's space is lost."""
  def decode(ids):
    return " ".join(f"t{i}" for i in ids if i != 0)

  stream = TextStream(decode)
  pieces = [stream.add([token]) for token in (93, 0, 20, 0, 0, 7)]
  assert "".join(pieces) == stream.text == decode([93, 0, 20, 0, 0, 7]) == "t93 t20 t7"
