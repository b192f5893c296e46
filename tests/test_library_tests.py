"""scripts/library_tests.py on a tiny fake package of tests: outcomes, known failures, exit status.

The fake package's modules run through the script's real path (one `python -m pytest` each,
with the script as plugin), once for the whole file; the rest checks the report built from them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_FAKE = {
    "fakelib/__init__.py": "",
    "fakelib/helpers.py": "VALUE = 1\n",  # Not a test module.
    "fakelib/core_test.py": """
        import unittest
        import pytest

        def test_passes():
          assert 1 + 1 == 2

        def test_fails():
          assert 1 + 1 == 3, "arithmetic is off"

        def test_skipped():
          pytest.skip("not on this machine")

        @pytest.mark.xfail(reason="known upstream")
        def test_expected_failure():
          assert False

        class Subtests(unittest.TestCase):

          def test_one_subtest_fails(self):
            for i in range(3):
              with self.subTest(i=i):
                self.assertLess(i, 2)
        """,
    "fakelib/sub/__init__.py": "",
    "fakelib/sub/flags_test.py": """
        from absl import flags
        from absl.testing import absltest

        _SIZE = flags.DEFINE_integer("fakelib_size", 3, "A flag the test reads, as grain's do.")

        class FlagsTest(absltest.TestCase):

          def test_reads_a_flag_at_its_default(self):
            self.assertEqual(_SIZE.value, 3)
        """,
    "fakelib/broken_test.py": "import a_module_nobody_installed\n",
    "fakelib/hangs_test.py": """
        import time

        def test_hangs():
          time.sleep(60)
        """,
}


@pytest.fixture(scope="module")
def library_tests():
  path = ROOT / "scripts" / "library_tests.py"
  spec = importlib.util.spec_from_file_location("library_tests", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["library_tests"] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  yield module
  sys.modules.pop("library_tests", None)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """A folder holding the fake package, on sys.path as site-packages would be."""
  root = tmp_path_factory.mktemp("site")
  for name, text in _FAKE.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(textwrap.dedent(text))
  sys.path.insert(0, str(root))
  importlib.invalidate_caches()
  yield root
  sys.path.remove(str(root))
  for name in [m for m in sys.modules if m == "fakelib" or m.startswith("fakelib.")]:
    del sys.modules[name]


@pytest.fixture(scope="module")
def results(library_tests, site, tmp_path_factory):
  """Each fake module run once, through the script's own runner."""
  modules = library_tests.find_modules(["fakelib"], [])
  workdir = tmp_path_factory.mktemp("work")
  return [library_tests.run_module(m, timeout=1.5 if "hangs" in m.name else 60.0, workdir=workdir)
          for m in modules]


def test_it_finds_the_test_modules_a_package_ships_and_filters_them_by_glob(library_tests, site):
  names = [m.name for m in library_tests.find_modules(["fakelib"], [])]
  assert names == ["fakelib/broken_test.py", "fakelib/core_test.py", "fakelib/hangs_test.py",
                   "fakelib/sub/flags_test.py"]
  chosen = library_tests.find_modules(["fakelib"], ["fakelib/sub/*", "*/core_*"])
  assert [m.name for m in chosen] == ["fakelib/core_test.py", "fakelib/sub/flags_test.py"]
  assert {m.root for m in library_tests.find_modules(["fakelib"], [])} == {site}


def test_each_test_gets_its_worst_outcome_with_ids_relative_to_site_packages(results):
  tests = {test_id: outcome for r in results for test_id, (outcome, _) in r.tests.items()}
  assert tests == {
      "fakelib/broken_test.py": "error",  # Its collection failed.
      "fakelib/core_test.py::test_passes": "passed",
      "fakelib/core_test.py::test_fails": "failed",
      "fakelib/core_test.py::test_skipped": "skipped",
      "fakelib/core_test.py::test_expected_failure": "xfailed",
      "fakelib/core_test.py::Subtests::test_one_subtest_fails": "failed",  # One of 3 subtests.
      "fakelib/hangs_test.py": "timeout",
      "fakelib/sub/flags_test.py::FlagsTest::test_reads_a_flag_at_its_default": "passed",
  }
  messages = {test_id: message for r in results for test_id, (_, message) in r.tests.items()}
  assert "arithmetic is off" in messages["fakelib/core_test.py::test_fails"]
  assert "a_module_nobody_installed" in messages["fakelib/broken_test.py"]
  assert "after 1.5 s" in messages["fakelib/hangs_test.py"]


def test_read_outcomes_keeps_the_worst_report_of_each_test(library_tests):
  lines = [json.dumps({"id": i, "outcome": o, "message": m}) for i, o, m in [
      ("a", "passed", ""), ("a", "failed", "subtest 2"), ("a", "passed", ""),
      ("b", "passed", ""), ("b", "error", "teardown"), ("c", "skipped", "")]]
  assert library_tests.read_outcomes(lines + [""]) == {
      "a": ("failed", "subtest 2"), "b": ("error", "teardown"), "c": ("skipped", "")}


def test_known_failures_match_by_id_or_glob_and_only_the_others_are_new(library_tests, results):
  known = {"fakelib/core_test.py::test_fails": "upstream's arithmetic",
           "fakelib/core_test.py::Subtests::*": "its subtests",
           "fakelib/broken_test.py": "needs a module no extra installs",
           "fakelib/sub/flags_test.py::FlagsTest::test_gone": "fixed since"}
  report = library_tests.summarize(results, known)
  assert report["new_failures"] == ["fakelib/hangs_test.py"]
  assert report["known_not_failing"] == ["fakelib/sub/flags_test.py::FlagsTest::test_gone"]
  status = {m["module"]: m["status"] for m in report["modules"]}
  assert status == {"fakelib/broken_test.py": "KNOWN", "fakelib/core_test.py": "KNOWN",
                    "fakelib/hangs_test.py": "FAIL", "fakelib/sub/flags_test.py": "PASS"}
  core = next(m for m in report["modules"] if m["module"] == "fakelib/core_test.py")
  assert core["counts"] == {"passed": 1, "failed": 2, "skipped": 1, "xfailed": 1}
  assert {f["id"]: f["known"] for f in core["failures"]} == {
      "fakelib/core_test.py::Subtests::test_one_subtest_fails": "its subtests",
      "fakelib/core_test.py::test_fails": "upstream's arithmetic"}
  table = library_tests.text_table(report)
  assert "NEW FAILURE: fakelib/hangs_test.py" in table
  assert "fakelib/core_test.py" in table and "KNOWN (2 known)" in table


def test_the_exit_status_is_1_only_for_failures_not_in_the_known_file(library_tests, site,
                                                                       tmp_path):
  known = tmp_path / "known.yaml"
  known.write_text('"fakelib/core_test.py::test_fails": upstream\n')
  args = ["--packages", "fakelib", "--known", str(known), "--timeout", "30",
          "--out", str(tmp_path / "out")]
  assert library_tests.main([*args, "--modules", "fakelib/sub/*"]) == 0
  written = json.loads((tmp_path / "out" / "library_tests.json").read_text())
  assert [m["status"] for m in written["modules"]] == ["PASS"]
  assert "1 modules: 1 passed" in (tmp_path / "out" / "library_tests.txt").read_text()

  assert library_tests.main([*args, "--modules", "fakelib/core_test.py"]) == 1  # Its subtest.
  known.write_text('"fakelib/core_test.py::test_fails": upstream\n'
                   '"fakelib/core_test.py::Subtests::test_one_subtest_fails": upstream too\n')
  assert library_tests.main([*args, "--modules", "fakelib/core_test.py"]) == 0


def test_bad_arguments_exit_2_or_name_the_problem(library_tests, site, tmp_path, capsys):
  out = ["--out", str(tmp_path / "out")]
  assert library_tests.main(["--packages", "fakelib", "--modules", "nothing/*", *out]) == 2
  assert "no test module of fakelib matches 'nothing/*'" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="'no_such_package' is not installed"):
    library_tests.main(["--packages", "no_such_package", *out])
  known = tmp_path / "known.yaml"
  known.write_text('"fakelib/core_test.py::test_fails": ""\n')
  with pytest.raises(SystemExit, match="test_fails' needs a reason"):
    library_tests.main(["--packages", "fakelib", "--known", str(known), *out])
  known.write_text("- a list, not a mapping\n")
  with pytest.raises(SystemExit, match="must map test ids to reasons"):
    library_tests.main(["--packages", "fakelib", "--known", str(known), *out])
