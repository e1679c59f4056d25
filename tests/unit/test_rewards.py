import pytest

from async_agent_rl.rewards import (
    REWARD_FUNCTIONS,
    compute_rewards,
    exact_match,
    extract_answer,
    f1,
    format_em,
    format_score,
    get_reward_fn,
    normalize_answer,
    retrieval_hit,
    scoring_text,
    search_r1_em,
    substring_match,
    tag_count,
)

pytestmark = pytest.mark.unit

GOOD = (
    "<think> I need the city. </think>\n<search> Aldo Venmar </search>"
    "\n\n<information>Doc 1(Title: \"Aldo Venmar\") born in Zolgon.</information>\n\n"
    "<think> found it </think>\n<answer> Zolgon </answer>"
)


def test_normalize_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The  Eiffel-Tower, (Paris)! ") == "eiffeltower paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_last_answer_of_the_response_is_scored():
    text = "<answer> Wrong </answer> then <answer> Zolgon </answer>"
    assert extract_answer(text) == "Zolgon"
    assert exact_match(text, ["zolgon"]) == 1.0
    assert exact_match("<answer> Zolgon </answer> <answer> no </answer>", ["Zolgon"]) == 0.0


def test_a_single_answer_counts_no_two_match_quirk():
    # Search-R1's qa_em needs two matches because it counts the prompt's example; we score the response only.
    assert exact_match("<answer>Zolgon</answer>", ["Zolgon"]) == 1.0


def test_no_answer_tag_scores_zero_even_if_text_is_right():
    assert exact_match("Zolgon", ["Zolgon"]) == 0.0
    assert f1("Zolgon", ["Zolgon"]) == 0.0
    assert substring_match("Zolgon", ["Zolgon"]) == 0.0


def test_exact_match_any_gold_after_normalization():
    assert exact_match("<answer> the Kal Mark. </answer>", ["Guth dinar", "kal mark"]) == 1.0
    assert exact_match("<answer> kal marks </answer>", ["kal mark"]) == 0.0


def test_substring_match():
    assert substring_match("<answer> city of Zolgon, north </answer>", ["Zolgon"]) == 1.0
    assert substring_match("<answer> Zol </answer>", ["Zolgon"]) == 0.0


def test_token_f1():
    # pred tokens: [new, zolgon, city], gold: [zolgon, city]; overlap 2 -> P=2/3, R=1 -> F1=0.8
    assert f1("<answer> New Zolgon City </answer>", ["Zolgon City"]) == pytest.approx(0.8)
    assert f1("<answer> x </answer>", ["Zolgon City", "x"]) == pytest.approx(1.0)


def test_format_rule():
    assert format_score(GOOD, []) == 1.0
    assert format_score("<answer> a </answer>", []) == 1.0  # answering directly is well formed
    assert format_score("<search> q </search><answer> a </answer>", []) == 0.0  # search without information
    assert format_score("<think> a <answer> b </answer> </think>", []) == 0.0  # nested
    assert format_score("<think> x </think>", []) == 0.0  # no answer
    assert format_score(GOOD + "<answer> again </answer>", []) == 0.0  # two answers


def test_format_em_partial_credit():
    assert format_em(GOOD, ["Zolgon"]) == 1.0
    assert format_em(GOOD, ["Other"]) == pytest.approx(0.2)
    assert format_em("<search> q </search><answer> Zolgon </answer>", ["Zolgon"]) == pytest.approx(0.8)
    assert format_em("nothing", ["Zolgon"]) == 0.0


def test_search_r1_em_is_search_r1s_scoring():
    assert search_r1_em(GOOD, ["Zolgon"]) == 1.0
    assert search_r1_em(GOOD, ["Other"]) == pytest.approx(0.2)  # valid, wrong
    no_think = "<search> q </search>\n<information>x</information>\n<answer> Zolgon </answer>"
    assert search_r1_em(no_think, ["Zolgon"]) == pytest.approx(0.8)  # <think> is required there
    assert format_em(no_think, ["Zolgon"]) == 1.0  # ... and optional in format_em
    bad = "<search> q </search><answer> Other </answer>"
    assert search_r1_em(bad, ["Zolgon"]) == pytest.approx(0.1)  # invalid, wrong: final_format_score
    assert format_em(bad, ["Zolgon"]) == 0.0
    chatty = "<think> a </think> so: <answer> Zolgon </answer>"  # text between blocks
    assert search_r1_em(chatty, ["Zolgon"]) == pytest.approx(0.8) and format_em(chatty, ["Zolgon"]) == 1.0
    assert search_r1_em(GOOD + " bye", ["Zolgon"]) == pytest.approx(0.8)  # text after the answer
    assert search_r1_em("<think> x </think>", ["Zolgon"]) == 0.0  # no answer
    assert search_r1_em("nothing", ["Zolgon"]) == 0.0


def test_scoring_text_keeps_the_models_words_and_blanks_observations():
    pieces = [("model", "<think> a </think><search> q </search>"),
              ("search_results", "\n\n<information><answer> Zolgon </answer></information>\n\n"),
              ("model", "<think> b </think>")]  # fmt: skip
    text = scoring_text(pieces)
    assert text == "<think> a </think><search> q </search><information></information><think> b </think>"
    assert extract_answer(text) is None


def test_tag_count_and_retrieval_hit():
    assert tag_count(GOOD, []) == 1.0
    assert tag_count("<answer> a </answer> trailing", []) == 0.5
    assert retrieval_hit(GOOD, ["Zolgon"], retrieved_texts=["... born in Zolgon."]) == 1.0
    assert retrieval_hit(GOOD, ["Zolgon"], retrieved_texts=["Zolgonia is a country"]) == 0.0


def test_weighted_sum_and_registry():
    total, parts = compute_rewards([("exact_match", 1.0), ("format", 0.5)], GOOD, ["Zolgon"])
    assert parts == {"exact_match": 1.0, "format": 1.0} and total == 1.5
    assert set(REWARD_FUNCTIONS) >= {"exact_match", "substring_match", "f1", "format", "tag_count", "retrieval_hit"}
    with pytest.raises(KeyError, match="allowed"):
        get_reward_fn("nope")
