//! The prose of an OpenAI chat request, shared by the benchmarks that read request bodies.

/// The `messages` of a chat request, serialized, of at least `size` bytes: a system prompt, then user
/// and assistant turns of prose (with the quotes and newlines a conversation has, escaped).
pub fn conversation(size: usize) -> String {
    let sentences = [
        "Summarise the report below in three bullet points.\n",
        "The quarterly figures show a \"modest\" rise in throughput, 4.2 % over the last period. ",
        "Latency at the 99th percentile fell from 840 ms to 610 ms after the cache was resized. ",
        "Which of the two regions should take the next batch of nodes, and why?\n",
    ];
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": "You are a careful assistant. Answer briefly and cite the figures you use.",
    })];
    let mut length = 0;
    let mut turn = 0;
    while length < size {
        let content: String = (0..8)
            .map(|i| sentences[(turn + i) % sentences.len()])
            .collect();
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let message = serde_json::json!({"role": role, "content": content});
        length += message.to_string().len() + 1;
        messages.push(message);
        turn += 1;
    }
    serde_json::to_string(&messages).expect("JSON values serialize")
}
