"""The head section's one schema (specplug.common.head_section): every field's default,
its value from config.json, from the environment and from an engine argument, their
precedence (argument > environment > config.json > default), the source reported for
each, and each error message."""

from __future__ import annotations

import json
import logging

import pytest

from specplug.common import head_section as hs
from specplug.common.head_section import Argument, HeadSettings, MedusaTree, Verification, parse
from specplug.common.sampling import TYPICAL_DELTA, TYPICAL_EPSILON
from specplug.common.drafter_registry import DrafterChoice
from specplug.common.tree import TreeConfig


def value(section=None, environ=None, name="", **kw):
    parsed = parse(section, environ or {}, **kw)
    return parsed.value(name), parsed.sources[name]


# -- defaults -----------------------------------------------------------------------------


def test_no_section_gives_every_default_with_source_default():
    parsed = parse(None, {})
    assert parsed.settings == HeadSettings()
    assert set(parsed.sources.values()) == {"default"}
    assert parsed.settings.tree == TreeConfig()
    assert parsed.settings.verification == Verification("lossless", TYPICAL_EPSILON, TYPICAL_DELTA)
    assert (parsed.settings.stage, parsed.settings.adaptive, parsed.settings.drafter, parsed.settings.calibrate,
            parsed.settings.draft_temperature, parsed.settings.gate, parsed.settings.payoff,
            parsed.settings.head_weights) == ("chain", False, None, False, None, False, True, "float")
    assert parsed.settings.medusa == MedusaTree("optimal", None, None)
    names = {f"tree.{k}" for k in hs.TREE_KEYS} | {"verification.method", "verification.typical_epsilon",
                                                     "verification.typical_delta", "stage", "adaptive", "drafter",
                                                     "calibrate", "draft_temperature", "gate", "payoff",
                                                     "head_weights",
                                                     "medusa.shape", "medusa.choices", "medusa.head_accuracies"}
    assert set(parsed.sources) == names


def test_committed_heads_parse():
    from specplug import testbed_heads

    eagle = parse(hs.read_section(testbed_heads.ROOT / "smollm2-eagle3"), {})
    assert eagle.settings.tree == TreeConfig(depth=4, topk=4, budget=15, stop_below=0.5)
    assert (eagle.settings.head_weights, eagle.settings.drafter) == ("int4", DrafterChoice("retrieval", {}))
    medusa = parse(hs.read_section(testbed_heads.ROOT / "smollm2-medusa"), {}, num_heads=4)
    assert medusa.method == "medusa" and len(medusa.settings.medusa.head_accuracies) == 4
    rows = {r["name"]: r for r in medusa.rows()}
    assert rows["medusa.head_accuracies"] == {"name": "medusa.head_accuracies", "value": "4 heads x 10 ranks",
                                              "source": "config.json"}
    assert not any(r["name"].startswith("medusa.") for r in eagle.rows())


# -- the tree -----------------------------------------------------------------------------

TREE = {"tree": {"depth": 3, "topk": 2, "budget": 6, "stop_below": 0.1}}


@pytest.mark.parametrize("key, file, env, arg", [("depth", 3, 5, 2), ("topk", 2, 1, 3), ("budget", 6, 4, 9)])
def test_tree_precedence(key, file, env, arg):
    environ = {"SPECPLUG_TREE": json.dumps({key: env})}
    name = f"tree.{key}"
    assert value({}, {}, name) == (getattr(TreeConfig(), key), "default")
    assert value(TREE, {}, name) == (file, "config.json")
    assert value(TREE, environ, name) == (env, "env SPECPLUG_TREE")
    assert value(TREE, environ, name, arguments={name: Argument("--flag", arg)}) == (arg, "argument --flag")


def test_stop_below_from_file_and_env():
    assert value(TREE, {}, "tree.stop_below") == (0.1, "config.json")
    assert value(TREE, {"SPECPLUG_TREE": '{"stop_below": 0.3}'}, "tree.stop_below") == (0.3, "env SPECPLUG_TREE")
    assert value(TREE, {"SPECPLUG_TREE": '{"topk": 1}'}, "tree.stop_below") == (0.1, "config.json")  # key by key


@pytest.mark.parametrize("section, environ, arguments, message", [
    ({}, {"SPECPLUG_TREE": "topk=1"}, {}, "SPECPLUG_TREE must be a JSON object, got 'topk=1'"),
    ({}, {"SPECPLUG_TREE": "[1]"}, {}, "SPECPLUG_TREE must be a JSON object"),
    ({}, {"SPECPLUG_TREE": '{"width": 2}'}, {}, r"SPECPLUG_TREE has unknown keys \['width'\].*remove the extra"),
    ({"tree": {"widht": 2}}, {}, {}, r"specplug \"tree\" in config.json has unknown keys \['widht'\]"),
    ({"tree": [4]}, {}, {}, r"specplug \"tree\" in config.json must be an object of TreeConfig fields, got \[4\]"),
    ({"tree": {"depth": 0}}, {}, {}, "specplug tree.depth in config.json must be an int >= 1, got 0: pass a "
                                     "positive depth"),
    ({}, {"SPECPLUG_TREE": '{"topk": "2"}'}, {}, "SPECPLUG_TREE \"topk\" must be an int >= 1, got '2'"),
    ({}, {}, {"tree.budget": Argument("--speculative-num-draft-tokens minus one", 0)},
     "--speculative-num-draft-tokens minus one must be an int >= 1, got 0: pass a positive value or leave it unset"),
    ({"tree": {"stop_below": 1.0}}, {}, {}, r"tree.stop_below in config.json must be a probability in \[0, 1\)"),
])
def test_tree_errors(section, environ, arguments, message):
    with pytest.raises(ValueError, match=message):
        parse(section, environ, arguments=arguments)


def test_a_bad_file_value_is_refused_even_when_overridden():
    with pytest.raises(ValueError, match="tree.depth in config.json"):
        parse({"tree": {"depth": -1}}, {"SPECPLUG_TREE": '{"depth": 2}'})
    with pytest.raises(TypeError, match="adaptive"):
        parse({"adaptive": "yes"}, {"SPECPLUG_ADAPTIVE": "0"})


# -- verification -------------------------------------------------------------------------

TYPICAL_ARGS = {"verification.typical_epsilon": Argument("--speculative-accept-threshold-single", 0.2)}


def test_verification_lossless_from_file_typical_from_an_argument_only(caplog):
    assert value({"verification": "lossless"}, {}, "verification.method") == ("lossless", "config.json")
    with caplog.at_level(logging.WARNING, logger="specplug.common.head_section"):
        parsed = parse({"verification": "lossless"}, {}, arguments=TYPICAL_ARGS)
    assert parsed.settings.verification == Verification("typical", 0.2, TYPICAL_DELTA)
    assert parsed.sources["verification.method"] == "argument --speculative-accept-threshold-single"
    assert parsed.sources["verification.typical_delta"] == "default"
    assert any("typical acceptance (LOSSY)" in r.getMessage() for r in caplog.records)
    delta = parse({}, {}, arguments={"verification.typical_delta": Argument("--acc", 0.5)}).settings.verification
    assert delta == Verification("typical", TYPICAL_EPSILON, 0.5)


@pytest.mark.parametrize("section, arguments, message", [
    ({"verification": "typical"}, {}, "verification 'typical' in config.json is refused: typical acceptance is "
                                      "lossy.*--speculative-accept-threshold-single"),
    ({"verification": "greedy"}, {}, "specplug \"verification\" in config.json must be one of "
                                     r"\['lossless', 'typical'\], got 'greedy'"),
    ({}, {"verification.typical_epsilon": Argument("--speculative-accept-threshold-single", 1.5)},
     r"--speculative-accept-threshold-single must be a typical-acceptance threshold in \(0, 1\), got 1.5"),
    ({"draft_temperature": 0.7}, TYPICAL_ARGS, r"draft_temperature \(sampled drafts, from config.json\) must be "
                                               "unset with typical acceptance.*never reads q"),
])
def test_verification_errors(section, arguments, message):
    with pytest.raises(ValueError, match=message):
        parse(section, {}, arguments=arguments)


# -- stage and the flags ------------------------------------------------------------------


def test_stage():
    assert value({"stage": "tree"}, {}, "stage") == ("tree", "config.json")
    assert value({"stage": "tree"}, {"SPECPLUG_STAGE": "chain"}, "stage") == ("chain", "env SPECPLUG_STAGE")
    assert value({}, {"SPECPLUG_STAGE": " "}, "stage") == ("chain", "default")  # empty = unset
    with pytest.raises(ValueError, match=r"specplug stage must be one of \('chain', 'tree'\), got 'forest' "
                                         r"\(from env SPECPLUG_STAGE\): set \"stage\""):
        parse({}, {"SPECPLUG_STAGE": "forest"})
    with pytest.raises(ValueError, match=r"got 'bush' \(from config.json\)"):
        parse({"stage": "bush"}, {})


@pytest.mark.parametrize("key, env", [("adaptive", "SPECPLUG_ADAPTIVE"), ("calibrate", "SPECPLUG_CALIBRATE"),
                                      ("gate", "SPECPLUG_GATE")])
def test_flags(key, env):
    assert value({}, {}, key) == (False, "default")
    assert value({key: True}, {}, key) == (True, "config.json")
    assert value({key: True}, {env: "0"}, key) == (False, f"env {env}")
    assert value({}, {env: "yes"}, key) == (True, f"env {env}")
    with pytest.raises(ValueError, match=f"{env} must be 1/true/yes or 0/false/no, got 'maybe': set it to 1"):
        parse({}, {env: "maybe"})
    with pytest.raises(TypeError, match=f"specplug \"{key}\" in config.json must be true or false, got 'yes'"):
        parse({key: "yes"}, {})


def test_adaptive_argument_wins():
    on = {"adaptive": Argument("--speculative-adaptive", True)}
    assert value({}, {"SPECPLUG_ADAPTIVE": "0"}, "adaptive", arguments=on) == (True, "argument --speculative-adaptive")


# -- drafter, draft temperature, head weights ---------------------------------------------


def test_drafter():
    assert value({"retrieval": True}, {}, "drafter") == (DrafterChoice("retrieval", {}), "config.json")
    assert value({"retrieval": True}, {"SPECPLUG_RETRIEVAL": "0"}, "drafter") == (None, "env SPECPLUG_RETRIEVAL")
    assert value({}, {"SPECPLUG_RETRIEVAL": '{"budget": 2}'}, "drafter") == \
        (DrafterChoice("retrieval", {"budget": 2}), "env SPECPLUG_RETRIEVAL")
    assert value({"retrieval": True}, {"SPECPLUG_DRAFTER": "0"}, "drafter") == (None, "env SPECPLUG_DRAFTER")
    rows = {r["name"]: r for r in parse({"drafter": {"name": "retrieval", "budget": 3}}, {}).rows()}
    assert rows["drafter"] == {"name": "drafter", "value": {"name": "retrieval", "budget": 3}, "source": "config.json"}


@pytest.mark.parametrize("section, environ, message", [
    ({"retrieval": {"bugdet": 4}}, {}, r"specplug drafter \(from config.json\): .*unknown field"),
    ({}, {"SPECPLUG_RETRIEVAL": "{not json"}, "SPECPLUG_RETRIEVAL"),
    ({}, {"SPECPLUG_DRAFTER": "nope"}, r"specplug drafter \(from env SPECPLUG_DRAFTER\): unknown drafter 'nope'"),
    ({"retrieval": True, "drafter": "lookup"}, {"SPECPLUG_DRAFTER": "0"}, "both \"retrieval\" and \"drafter\""),
])
def test_drafter_errors(section, environ, message):
    with pytest.raises(ValueError, match=message):
        parse(section, environ)


def test_draft_temperature():
    assert value({"draft_temperature": 0.7}, {}, "draft_temperature") == (0.7, "config.json")
    assert value({"draft_temperature": 0.7}, {"SPECPLUG_DRAFT_TEMPERATURE": "0"}, "draft_temperature") == \
        (None, "env SPECPLUG_DRAFT_TEMPERATURE")  # 0: off
    assert value({}, {"SPECPLUG_DRAFT_TEMPERATURE": " 1.5"}, "draft_temperature") == \
        (1.5, "env SPECPLUG_DRAFT_TEMPERATURE")
    assert value({"draft_temperature": 0.7}, {"SPECPLUG_DRAFT_TEMPERATURE": ""}, "draft_temperature") == \
        (0.7, "config.json")  # empty = unset
    with pytest.raises(ValueError, match=r"SPECPLUG_DRAFT_TEMPERATURE must be a temperature > 0 \(or 0 / unset"):
        parse({}, {"SPECPLUG_DRAFT_TEMPERATURE": "-1"})
    with pytest.raises(ValueError, match="specplug.draft_temperature in the head's config.json must be a temperature"):
        parse({"draft_temperature": "hot"}, {})


def test_head_weights():
    assert value({"head_weights": "int4"}, {}, "head_weights") == ("int4", "config.json")
    assert value({"head_int8": True}, {}, "head_weights") == ("int8", "config.json")
    assert value({"head_weights": "int4", "head_int8": True}, {}, "head_weights") == ("int4", "config.json")
    assert value({"head_weights": "int4"}, {"SPECPLUG_HEAD_INT8": "1"}, "head_weights") == \
        ("int8", "env SPECPLUG_HEAD_INT8")
    assert value({"head_int8": True}, {"SPECPLUG_HEAD_INT8": "1", "SPECPLUG_HEAD_WEIGHTS": "INT4"},
                 "head_weights") == ("int4", "env SPECPLUG_HEAD_WEIGHTS")
    with pytest.raises(ValueError, match=r"specplug \"head_weights\" in config.json must be one of \['float', "
                                         r"'int8', 'int4'\], got 'fp8'"):
        parse({"head_weights": "fp8"}, {})
    with pytest.raises(ValueError, match="SPECPLUG_HEAD_WEIGHTS must be one of .*got 'int3'"):
        parse({}, {"SPECPLUG_HEAD_WEIGHTS": "int3"})
    with pytest.raises(TypeError, match="head_int8"):
        parse({"head_int8": "yes"}, {})


# -- Medusa heads -------------------------------------------------------------------------

MEDUSA = {"method": "medusa", "tree": {"depth": 4, "topk": 2, "budget": 7}, "head_accuracies": [[0.5, 0.2]] * 4}


def test_medusa_shape_from_file_then_env(tmp_path):
    assert value(MEDUSA, {}, "medusa.shape") == ("optimal", "default")
    assert value({**MEDUSA, "choices": [[0], [1]]}, {}, "medusa.choices") == (((0,), (1,)), "config.json")
    env = {"SPECPLUG_MEDUSA_TREE": "[[0], [0, 0]]"}
    assert value({**MEDUSA, "choices": [[0], [1]]}, env, "medusa.choices") == \
        (((0,), (0, 0)), "env SPECPLUG_MEDUSA_TREE")
    (tmp_path / "c.json").write_text("[[1]]")
    assert value(MEDUSA, {"SPECPLUG_MEDUSA_TREE": str(tmp_path / "c.json")}, "medusa.choices")[0] == ((1,),)
    chain = parse(MEDUSA, {"SPECPLUG_MEDUSA_TREE": "chain"}, num_heads=3)
    assert chain.settings.tree == TreeConfig(depth=3, topk=1, budget=3) and chain.settings.medusa.shape == "chain"
    assert chain.sources["tree.topk"] == chain.sources["tree.budget"] == "env SPECPLUG_MEDUSA_TREE"
    assert parse(MEDUSA, {"SPECPLUG_MEDUSA_TREE": "chain"}).settings.tree == TreeConfig(depth=4, topk=1, budget=4)
    assert parse({"tree": {"depth": 2}}, {"SPECPLUG_MEDUSA_TREE": "bad"}).settings.medusa == MedusaTree()  # EAGLE


def test_medusa_depth_is_kept_within_the_heads():
    assert value(MEDUSA, {}, "tree.depth", num_heads=3) == (3, "config.json")  # cut to the heads
    assert value({"method": "medusa"}, {}, "tree.depth", num_heads=2) == (2, "default")
    arg = {"tree.depth": Argument("--speculative-num-steps", 9)}
    with pytest.raises(ValueError, match="--speculative-num-steps must be at most the number of Medusa heads "
                                         r"\(3\), got 9: pass --speculative-num-steps 3 or fewer"):
        parse(MEDUSA, {}, method="medusa", arguments=arg, num_heads=3)


@pytest.mark.parametrize("section, environ, message", [
    (MEDUSA, {"SPECPLUG_MEDUSA_TREE": "bushy"}, r"SPECPLUG_MEDUSA_TREE must be one of \('optimal', 'chain'\), JSON "
                                                "Medusa choices.*got 'bushy': fix the environment variable"),
    (MEDUSA, {"SPECPLUG_MEDUSA_TREE": "[[0], [0, 0, 0, 0]]"}, r"SPECPLUG_MEDUSA_TREE must be choices no deeper than "
                                                             r"the number of heads \(3\), got 4"),
    ({**MEDUSA, "choices": [[0], []]}, {}, "specplug \"choices\" in config.json must be Medusa choices"),
    ({**MEDUSA, "head_accuracies": [0.5]}, {}, "specplug \"head_accuracies\" in config.json must be a list per head"),
])
def test_medusa_errors(section, environ, message):
    with pytest.raises(ValueError, match=message):
        parse(section, environ, num_heads=3)


# -- the section itself -------------------------------------------------------------------


def test_method_and_section_form(caplog):
    with pytest.raises(TypeError, match="'specplug' must be an object, got list"):
        parse([1], {})
    with pytest.raises(ValueError, match=r"specplug \"method\" in config.json must be one of"):
        parse({"method": "eagle"}, {})
    with pytest.raises(ValueError, match="says method 'eagle3', but it is served as a 'medusa' head"):
        parse({"method": "eagle3"}, {}, method="medusa")
    with caplog.at_level(logging.WARNING, logger="specplug.common.head_section"):
        parse({"adaptve": True}, {})
    assert any("unknown keys ['adaptve']" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="an adapter maps arguments onto"):
        parse({}, {}, arguments={"stage": Argument("--stage", "tree")})


def test_read_section(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert hs.read_section(tmp_path) == {}
    (tmp_path / "config.json").write_text(json.dumps({"specplug": {"stage": "tree"}}))
    assert hs.read_section(tmp_path) == {"stage": "tree"}


def test_the_older_int8_switch_reads_as_head_weights():
    assert value({"head_int8": True}, {}, "head_weights") == ("int8", "config.json")


def test_label_prefixes_errors_and_keeps_their_type():
    with pytest.raises(ValueError, match="^MEDUSA: .*tree.topk"):
        parse({"tree": {"topk": 0}}, {}, label="MEDUSA")
    with pytest.raises(hs.SettingTypeError, match="^X: "):
        parse({"tree": "deep"}, {}, label="X")


def test_verification_rule_and_medusa_nodes():
    assert Verification().rule == "rejection" and Verification(method="typical").rule == "typical"
    assert HeadSettings(medusa=MedusaTree(shape="choices", choices=((0,), (1,)))).medusa_nodes == 3
    assert HeadSettings().medusa_nodes == TreeConfig().static_nodes + 1


@pytest.mark.parametrize("section", [{}, {"tree": {"depth": 9}}, {"tree": {"topk": 1, "depth": 9}},
                                     {"tree": {"topk": 3, "depth": 2, "budget": 64}},
                                     {"medusa": {"shape": "choices", "choices": [[0], [1], [0, 0]]}}])
def test_medusa_nodes_is_the_drafters_tree(section):
    """HeadSettings.medusa_nodes (what both engines reserve) is the node count of the tree
    MedusaDrafter builds, the depth cut to the heads, for every tree shape."""
    from types import SimpleNamespace

    from specplug.common.drafters import MedusaDrafter

    settings = parse(section, {}, method="medusa", num_heads=3).settings
    heads = SimpleNamespace(num_heads=3, eval=lambda: heads)
    drafter = MedusaDrafter(heads, choices=settings.medusa.choices)
    assert settings.medusa_nodes == drafter.template(settings.tree).num_nodes


def test_refuse_unsupported_names_the_key_its_variable_and_the_fix():
    settings = parse({"gate": True}, {"SPECPLUG_DRAFTER": "retrieval"}).settings
    hs.refuse_unsupported(settings, "path P", ("adaptive", "draft_temperature"), "fix F")  # neither is on
    with pytest.raises(ValueError, match="^specplug path P does not support 'gate': drop it from the head's specplug "
                                         r"section \(or unset SPECPLUG_GATE\), or fix F$"):
        hs.refuse_unsupported(settings, "path P", ("adaptive", "gate", "drafter"), "fix F")
    with pytest.raises(ValueError, match="'drafter'.*SPECPLUG_DRAFTER / SPECPLUG_RETRIEVAL"):
        hs.refuse_unsupported(settings, "path P", ("drafter", "gate"), "fix F")


def test_medusa_head_count_reads_either_key(tmp_path):
    from specplug.common.heads.medusa import faster_decoding_config, medusa_head_count

    for config, heads in (({"medusa_num_heads": 3, "num_heads": 5}, 3), ({"num_heads": 4}, 4)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert medusa_head_count(tmp_path) == heads
    assert faster_decoding_config(tmp_path) is None  # vLLM's format
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    assert faster_decoding_config(tmp_path) == {"medusa_num_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="medusa_num_heads .* must be an int >= 1, got None"):
        medusa_head_count(tmp_path)
    assert faster_decoding_config(tmp_path / "missing") is None
