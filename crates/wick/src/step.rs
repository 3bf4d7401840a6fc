//! Step scopes over candle tensors. Tensors made inside a step are owned by the step's closure,
//! so they are released when it returns — on success, on `?`, on any error; only the value the
//! closure returns leaves the step, which is how a value is kept on purpose. The engine measures
//! what the step used and freed.

use crate::engine::Engine;

/// What one step did to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StepReport {
    /// Allocated bytes before the step.
    pub before: usize,
    /// Highest allocated bytes during the step, where an exact source exists (the tracking
    /// allocator, a CUDA pool); `None` where only the resident set is known, which cannot see a
    /// step's transient peak.
    pub peak: Option<usize>,
    /// Allocated bytes after the step's temporaries were released.
    pub after: usize,
}

impl StepReport {
    /// Bytes the step's end released (peak minus after), where the peak is known.
    pub fn freed(&self) -> Option<usize> {
        self.peak.map(|p| p.saturating_sub(self.after))
    }
    /// Bytes the step left allocated (what it returned, and anything it stored elsewhere).
    pub fn retained(&self) -> isize {
        self.after as isize - self.before as isize
    }
}

impl Engine {
    /// Runs one step. Whatever the closure returns, its temporaries are dropped before the
    /// figures after the step are read. `label` is pushed onto the label stack while the body
    /// runs ([`Engine::label`]), so a recorded history names the step.
    pub fn step<T, E>(&self, label: &str, body: impl FnOnce(&Engine) -> Result<T, E>) -> (Result<T, E>, StepReport) {
        self.reset_peak_memory_stats();
        let before = self.allocated().bytes;
        let labelled = self.label(label);
        let result = body(self);
        drop(labelled);
        // The closure has returned: everything it created and did not return is gone now.
        let after = self.allocated().bytes;
        let peak = self.peak_allocated().map(|p| p.bytes.max(after).max(before));
        self.mark(label);
        (result, StepReport { before, peak, after })
    }

    /// Like [`Engine::step`], for steps whose errors are memory errors or candle errors.
    pub fn try_step<T>(
        &self,
        label: &str,
        body: impl FnOnce(&Engine) -> Result<T, crate::Error>,
    ) -> Result<(T, StepReport), crate::Error> {
        let (result, report) = self.step(label, body);
        self.count_candle_oom(&result);
        result.map(|value| (value, report))
    }

    /// Counts candle's out-of-memory (CUDA's) in `num_ooms`; wick's own refusals were counted
    /// where they were made.
    fn count_candle_oom<T>(&self, result: &Result<T, crate::Error>) {
        if let Err(crate::Error::Candle(e)) = result {
            if crate::is_out_of_memory(e) {
                self.ooms.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Like [`Engine::try_step`] for a step over `batch` samples, refused *before it runs* when
    /// its predicted peak does not fit: the last measured run of the same `label` rose `g` bytes
    /// above the memory before it at batch `b`, so this one is predicted to rise `g × batch / b`
    /// (activations grow with the batch; a step's fixed part only makes this conservative). The
    /// first run of a label has nothing to scale and runs; so does every run where no exact peak
    /// is known (no counting allocator or caching heap on the CPU). On the CPU this is what stands
    /// between a too-large batch and an aborted process: candle's allocations cannot fail.
    pub fn try_step_batch<T>(
        &self,
        label: &str,
        batch: usize,
        body: impl FnOnce(&Engine) -> Result<T, crate::Error>,
    ) -> Result<(T, StepReport), crate::Error> {
        let last = self.step_growth.lock().unwrap_or_else(|p| p.into_inner()).get(label).copied();
        if let Some((measured_batch, growth)) = last.filter(|(b, _)| *b > 0) {
            let predicted = growth.saturating_mul(batch).div_ceil(measured_batch);
            self.preflight(predicted, &format!("step `{label}` at batch {batch}, scaled from batch {measured_batch}"))?;
        }
        let (result, report) = self.step(label, body);
        self.count_candle_oom(&result);
        if let (Ok(_), Some(peak)) = (&result, report.peak) {
            let growth = peak.saturating_sub(report.before);
            self.step_growth.lock().unwrap_or_else(|p| p.into_inner()).insert(label.to_string(), (batch, growth));
        }
        result.map(|value| (value, report))
    }
}
