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
