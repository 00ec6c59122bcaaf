"""Long-document prompts for training heads, made from the model's own text.

Prompts of a few dozen words teach a head nothing about the tasks where a
user pastes a document: summarising it, or answering a question from
retrieved passages, where the reply copies and paraphrases text from a
thousand tokens back. This builds such prompts without outside text: the
base model answers some training prompts (greedy, cached and resumable as in
train-head), and each long prompt joins several of those answers into one
document with an instruction, either a summary of it or a question answered
from its numbered passages (the question being the prompt one of them
answered). The lines go into a JSONL file that train-head reads like any
prompt file; its held-out split is by id, as for every prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from core.training.answers import Answer, AnswerParams, Prompt, generate_answers, plan_batches, read_prompts, training_ids

SUMMARIES = (
    "Summarize the following text in a few sentences.\n\n{document}",
    "{document}\n\nWrite a short summary of the text above.",
    "Read this document and list its main points.\n\n{document}",
    "Give a one-paragraph summary of these notes:\n\n{document}",
    "Here is an article:\n\n{document}\n\nSummarize it for a busy reader.",
)
DOCUMENTS_FILE = "documents.jsonl"  # the passages' answers, in --work
QUESTIONS = (
    "Use the passages below to answer the question.\n\n{passages}\n\nQuestion: {question}",
    "Context:\n{passages}\n\nBased on the context above: {question}",
    "{passages}\n\nAnswer using the information in the documents above: {question}",
    "Documents:\n{passages}\n\n{question}",
)


MIN_PASSAGES = 4  # the fewest passages the documents are made of


@dataclass(frozen=True)
class LongParams:
    count: int = 300  # long prompts to write
    min_tokens: int = 800  # each document's length in tokens, about
    max_tokens: int = 1500
    seed: int = 0
    min_passage: int = 40  # answers shorter than this many tokens make no passage


def passages_of(answers: list[Answer], tokenizer, stops: set[int], shortest: int) -> list[tuple[str, str]]:
    """(prompt id, text) of every answer of `shortest` tokens or more (one cut
    by --max-new-tokens ends mid-sentence, as an excerpt does)."""
    texts = []
    for answer in answers:
        ids = [token for token in answer.answer_ids if token not in stops]
        if len(ids) >= shortest:
            texts.append((answer.id, tokenizer.decode(ids, skip_special_tokens=True).strip()))
    return texts


def build(passages: list[tuple[str, str]], questions: dict[str, str], tokenizer, params: LongParams) -> list[dict]:
    """The long prompts: documents of several passages, between about
    min_tokens and max_tokens, alternately summaries and questions; at least
    MIN_PASSAGES passages (long_prompts refuses fewer)."""
    rng = random.Random(params.seed)
    lengths = {pid: len(tokenizer.encode(text, add_special_tokens=False)) for pid, text in passages}
    rows, short = [], 0
    for index in range(params.count):
        target = rng.randint(params.min_tokens, params.max_tokens)
        chosen, total = [], 0
        for pid, text in rng.sample(passages, len(passages)):
            if chosen and total + lengths[pid] > params.max_tokens and total >= params.min_tokens // 2:
                continue
            chosen.append((pid, text))
            total += lengths[pid]
            if total >= target:
                break
        short += total < params.min_tokens
        if index % 2 == 0:
            template = rng.choice(SUMMARIES)
            prompt = template.format(document="\n\n".join(text for _, text in chosen))
            kind = "summarization-long"
        else:
            asked = rng.choice(chosen)[0]
            passages_text = "\n\n".join(f"Passage {number}: {text}" for number, (_, text) in enumerate(chosen, 1))
            prompt = rng.choice(QUESTIONS).format(passages=passages_text, question=questions[asked].strip())
            kind = "rag-long"
        rows.append({"id": f"long-{params.seed}-{index}", "source": kind, "turns": [prompt]})
    if short:  # too few passages for the length asked: documents come out shorter, and repeat them
        print(f"note: {short} of the {params.count} documents are shorter than --min-tokens {params.min_tokens}: the "
              f"{len(passages)} passages hold {sum(lengths.values()):,} tokens in all; answer more prompts (--documents)", flush=True)  # fmt: skip
    return rows


def long_prompts(base, prompts_path: Path, work: Path, documents: int, params: LongParams,
                 answer_params: AnswerParams, progress: bool = True) -> list[dict]:
    """Answer the first `documents` prompts of prompts_path that train-head
    does not hold out (greedy; cached in work/DOCUMENTS_FILE) and build
    params.count long prompts from the answers (JSONL rows)."""
    from core.prompt import stop_token_ids
    from core.training.features import FeatureParams, is_held_out

    held_out = FeatureParams().eval_fraction  # train-head's held-out prompts stay out of every document
    prompts: list[Prompt] = [
        prompt for prompt in read_prompts(prompts_path, base.tokenizer, answer_params.max_prompt_tokens)
        if not is_held_out(prompt.id, held_out)
    ][:documents]
    cached = generate_answers(base, prompts, work / DOCUMENTS_FILE, answer_params, None, progress)
    made = {(answer.id, answer.sample): answer for answer in cached}
    # the planned answers alone, in the order a new cache holds them: the cache may hold more (an earlier, larger
    # --documents; another prompt file's ids), which stay there unused
    answers = [made[prompt.id, sample] for batch in plan_batches(prompts, answer_params) for prompt, sample in batch]
    questions = {pid: row["turns"][0] for pid, row in training_ids(prompts_path).items()}
    passages = passages_of(answers, base.tokenizer, set(stop_token_ids(base.model, base.tokenizer)), params.min_passage)
    if len(passages) < MIN_PASSAGES:  # said with what would give more
        ways = []
        if len(passages) < len(answers):  # answers that ended sooner
            ways.append(f"{len(answers) - len(passages)} of the {len(answers)} answers are shorter: lower --min-passage-tokens")
        if len(prompts) < documents:  # every prompt the file lends was answered: a larger --documents adds none
            ways.append(f"{prompts_path} gives {len(prompts)} prompts to answer (train-head's held-out ones are left out): "
                        "give a file of more prompts")  # fmt: skip
        else:
            ways.append("answer more prompts (--documents)")
        raise ValueError(f"long prompts need at least {MIN_PASSAGES} passages (answers of {params.min_passage} tokens "
                         f"or more); there are {len(passages)}: {'; or '.join(ways)}")  # fmt: skip
    return build(passages, questions, base.tokenizer, params)
